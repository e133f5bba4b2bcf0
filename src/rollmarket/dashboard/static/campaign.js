// rollmarket campaign page: each condition's mean curve over seeds with its 95% t band, one chart per
// metric. Data from the page's own <script id="campaign-curves"> (its JSON twin's `curves`); no network.
(function () {
  "use strict";
  var source = document.getElementById("campaign-curves");
  if (!source || !window.Chart) return;
  var charts = JSON.parse(source.textContent);
  var palette = ["#2166ac", "#b42318", "#1a7f37", "#9a6700", "#6f42c1", "#0b7285", "#c2255c", "#495057"];

  charts.forEach(function (chart, index) {
    var canvas = document.getElementById("curve-" + index);
    if (!canvas) return;
    var datasets = [];
    chart.conditions.forEach(function (curve, i) {
      var colour = palette[i % palette.length];
      function pts(field) {
        // A step with one seed has no interval: a gap in the band, not a zero-width band.
        return curve.points.map(function (p) { return { x: p.step, y: p[field] === null ? null : p[field] }; });
      }
      // The band is two datasets, its lower edge and its upper edge filled down to it ("-1").
      datasets.push({ label: curve.condition + " 95% lo", data: pts("lo"), borderWidth: 0, pointRadius: 0,
                      fill: false, band: "lo", condition: curve.condition });
      datasets.push({ label: curve.condition + " 95% band", data: pts("hi"), borderWidth: 0, pointRadius: 0,
                      fill: "-1", backgroundColor: colour + "33", band: "hi", condition: curve.condition });
      datasets.push({ label: curve.condition, data: pts("mean"), borderColor: colour, backgroundColor: colour,
                      borderWidth: 2, pointRadius: 2, fill: false, condition: curve.condition });
    });
    new window.Chart(canvas, {
      type: "line",
      data: { datasets: datasets },
      options: {
        animation: false, responsive: false, spanGaps: false,
        plugins: {
          legend: { labels: { filter: function (item, data) { return !data.datasets[item.datasetIndex].band; }, boxWidth: 12 } },
          tooltip: { filter: function (item) { return !item.dataset.band; } },
        },
        scales: {
          x: { type: "linear", title: { display: true, text: "step" } },
          y: { title: { display: true, text: chart.metric } },
        },
      },
    });
  });
})();
