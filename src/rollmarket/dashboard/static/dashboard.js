// rollmarket observatory: the token tooltip and the length-scaling charts. No build step, no network.
(function () {
  "use strict";

  // ---- token tooltip: both logprobs and Δ for the hovered token
  var tip = document.getElementById("tip");
  function showTip(el) {
    var d = el.dataset;
    tip.innerHTML = "";
    var rows = [["rollout logprob", d.rollout], ["trainer (" + (d.trainerName || "") + ") logprob", d.trainer], ["Δ", d.delta]];
    if (d.pos !== undefined) rows.push(["position", d.pos]);
    rows.forEach(function (row) {
      var line = document.createElement("div");
      var key = document.createElement("b");
      key.textContent = row[0] + " ";
      line.appendChild(key);
      line.appendChild(document.createTextNode(row[1]));
      tip.appendChild(line);
    });
    tip.hidden = false;
    var box = el.getBoundingClientRect();
    tip.style.left = Math.max(4, window.scrollX + box.left) + "px";
    tip.style.top = (window.scrollY + box.bottom + 6) + "px";
  }
  if (tip) {
    document.addEventListener("mouseover", function (e) {
      var el = e.target.closest && e.target.closest(".tok[data-rollout]");
      if (el) showTip(el);
    });
    document.addEventListener("mouseout", function (e) {
      var el = e.target.closest && e.target.closest(".tok[data-rollout]");
      if (el && !(e.relatedTarget && el.contains(e.relatedTarget))) tip.hidden = true;
    });
  }

  // ---- length-scaling charts (Chart.js, vendored under static/vendor)
  var source = document.getElementById("length-data");
  if (!source || !window.Chart) return;
  var series = JSON.parse(source.textContent);
  var palette = ["#2166ac", "#1a7f37", "#b42318", "#9a6700", "#6f42c1", "#0b7285", "#c2255c", "#495057"];
  var ticks = [];
  series.forEach(function (s) { s.points.forEach(function (p) { if (ticks.indexOf(p.max_tokens) < 0) ticks.push(p.max_tokens); }); });
  ticks.sort(function (a, b) { return a - b; });

  function datasets(key) {
    var out = [];
    series.forEach(function (s, i) {
      var colour = palette[i % palette.length];
      var label = s.rollout_engine + " × " + s.trainer_engine;
      function pts(field) {
        return s.points.map(function (p) { return { x: p.max_tokens, y: p[key][field] }; });
      }
      out.push({ label: label + " lo", data: pts("lo"), borderWidth: 0, pointRadius: 0, fill: false, band: true });
      out.push({ label: label + " hi", data: pts("hi"), borderWidth: 0, pointRadius: 0, fill: "-1",
                 backgroundColor: colour + "22", band: true });
      out.push({ label: label, data: pts("mean"), borderColor: colour, backgroundColor: colour, borderWidth: 2,
                 pointRadius: 3, fill: false });
    });
    return out;
  }

  function draw(id, key, title) {
    var canvas = document.getElementById(id);
    if (!canvas) return;
    new window.Chart(canvas, {
      type: "line",
      data: { datasets: datasets(key) },
      options: {
        animation: false, responsive: false, parsing: true,
        plugins: {
          legend: { labels: { filter: function (item, data) { return !data.datasets[item.datasetIndex].band; }, boxWidth: 12 } },
          tooltip: { filter: function (item) { return !item.dataset.band; } },
        },
        scales: {
          x: { type: "logarithmic", title: { display: true, text: "max_tokens" },
               afterBuildTicks: function (axis) { axis.ticks = ticks.map(function (v) { return { value: v }; }); },
               ticks: { callback: function (v) { return String(v); } } },
          y: { title: { display: true, text: title } },
        },
      },
    });
  }
  draw("chart-ess", "token_ess", "token ESS");
  draw("chart-delta", "mean_abs_delta", "mean |Δlogp|");
})();
