// rollmarket training run page: curves of metrics.jsonl against step, wall time or tokens, with the
// held-out interval band, a metric chooser, EMA smoothing, log scale, overlays and (for a running
// run on a server) live updates from /train/<id>/metrics.json?after=<step>. No build step, no network.
(function () {
  "use strict";
  var source = document.getElementById("train-data");
  var host = document.getElementById("charts");
  if (!source || !host || !window.Chart) return;
  var page = JSON.parse(source.textContent);
  var script = document.currentScript;
  var runs = [page.metrics].concat(page.overlays);
  var palette = ["#2166ac", "#b42318", "#1a7f37", "#9a6700", "#6f42c1", "#0b7285", "#c2255c", "#495057"];
  var state = { x: "steps", smooth: 0, log: false };
  var charts = [];  // {panel, chart, figure}
  var custom = 0;

  // ---- data: a run's points of one key, on the chosen x axis
  function stepIndex(run) {
    if (!run._index || run._index.n !== run.steps.length) {
      var m = {};
      run.steps.forEach(function (s, i) { m[s] = i; });
      run._index = { n: run.steps.length, map: m };
    }
    return run._index.map;
  }
  function xAt(run, i) { return state.x === "steps" ? run.steps[i] : run[state.x][i]; }
  function ema(points) {
    var a = state.smooth;
    if (!a) return points;
    var s = null;
    return points.map(function (p) {
      s = s === null ? p.y : a * s + (1 - a) * p.y;
      return { x: p.x, y: s };
    });
  }
  function linePoints(run, key) {
    var col = run.columns[key] || [];
    var out = [];
    for (var i = 0; i < col.length; i++) if (col[i] !== null && col[i] !== undefined) out.push({ x: xAt(run, i), y: col[i] });
    return out;
  }
  function evalPoints(run, key) {
    var index = stepIndex(run);
    return run.evals.filter(function (p) { return p.metric === key; }).map(function (p) {
      var i = index[p.step];
      var x = state.x === "steps" ? p.step : (i === undefined ? null : run[state.x][i]);
      return { x: x, mean: p.mean, lo: p.lo, hi: p.hi };
    }).filter(function (p) { return p.x !== null; });
  }

  function datasets(panel) {
    var out = [];
    runs.forEach(function (run, r) {
      var suffix = runs.length > 1 ? " · " + run.run_id : "";
      var dash = r ? [6, 4] : [];
      panel.keys.forEach(function (key, k) {
        var colour = palette[(k + r * panel.keys.length) % palette.length];
        var label = key + suffix;
        if (panel.kind === "stacked") {
          out.push({ type: "bar", label: label, data: linePoints(run, key), backgroundColor: colour + (r ? "88" : ""),
                     stack: run.run_id, key: key, run: run.run_id });
          return;
        }
        var evals = panel.band ? evalPoints(run, key) : [];
        if (evals.length) {
          var lo = evals.filter(function (p) { return p.lo !== null; });
          out.push({ label: label + " lo", data: lo.map(function (p) { return { x: p.x, y: p.lo }; }),
                     borderWidth: 0, pointRadius: 0, fill: false, band: true });
          out.push({ label: label + " hi", data: lo.map(function (p) { return { x: p.x, y: p.hi }; }),
                     borderWidth: 0, pointRadius: 0, fill: "-1", backgroundColor: colour + "26", band: true });
          out.push({ label: label, data: ema(evals.map(function (p) { return { x: p.x, y: p.mean }; })),
                     borderColor: colour, backgroundColor: colour, borderDash: dash, borderWidth: 2, pointRadius: 2,
                     fill: false, key: key, run: run.run_id });
          return;
        }
        var points = linePoints(run, key);
        out.push({ label: label, data: ema(points), borderColor: colour, backgroundColor: colour, borderDash: dash,
                   borderWidth: 2, pointRadius: points.length > 200 ? 0 : 2, fill: false, key: key, run: run.run_id });
      });
    });
    return out;
  }

  var xTitles = { steps: "step", wall_s: "wall time (s)", tokens: "tokens" };
  function options(panel) {
    return {
      animation: false, responsive: false, parsing: true, normalized: true,
      plugins: {
        legend: { labels: { boxWidth: 10, filter: function (item, data) { return !data.datasets[item.datasetIndex].band; } } },
        tooltip: { filter: function (item) { return !item.dataset.band; } },
      },
      scales: {
        x: { type: "linear", stacked: panel.kind === "stacked", title: { display: true, text: xTitles[state.x] } },
        y: { type: state.log && panel.kind !== "stacked" ? "logarithmic" : "linear", stacked: panel.kind === "stacked" },
      },
    };
  }

  function addChart(panel, removable) {
    var figure = document.createElement("figure");
    figure.className = "chart";
    figure.dataset.panel = panel.id;
    figure.setAttribute("data-testid", "chart");
    var caption = document.createElement("figcaption");
    caption.textContent = panel.title;
    if (removable) {
      var remove = document.createElement("button");
      remove.type = "button"; remove.className = "remove"; remove.textContent = "×"; remove.title = "remove this chart";
      remove.addEventListener("click", function () {
        charts = charts.filter(function (c) { return c.figure !== figure; });
        Chart.getChart(canvas).destroy();
        figure.remove();
      });
      caption.appendChild(remove);
    }
    var canvas = document.createElement("canvas");
    canvas.id = "chart-" + panel.id;
    canvas.width = 426; canvas.height = 240;
    figure.appendChild(caption);
    figure.appendChild(canvas);
    host.appendChild(figure);
    var chart = new window.Chart(canvas, { type: panel.kind === "stacked" ? "bar" : "line",
                                           data: { datasets: datasets(panel) }, options: options(panel) });
    charts.push({ panel: panel, chart: chart, figure: figure });
  }

  function redraw() {
    charts.forEach(function (c) {
      c.chart.data.datasets = datasets(c.panel);
      c.chart.options = options(c.panel);
      c.chart.update();
    });
  }

  page.panels.forEach(function (panel) { addChart(panel, false); });

  // ---- controls
  var xAxis = document.getElementById("x-axis");
  var smoothing = document.getElementById("smoothing");
  var smoothingValue = document.getElementById("smoothing-value");
  var logScale = document.getElementById("log-scale");
  var choice = document.getElementById("metric-choice");
  xAxis.addEventListener("change", function () { state.x = xAxis.value; redraw(); });
  smoothing.addEventListener("input", function () {
    state.smooth = Number(smoothing.value); smoothingValue.textContent = smoothing.value; redraw();
  });
  logScale.addEventListener("change", function () { state.log = logScale.checked; redraw(); });
  document.getElementById("add-chart").addEventListener("click", function () {
    var key = choice.value;
    if (!key) return;
    custom += 1;
    addChart({ id: "custom-" + custom, title: key, keys: [key], kind: key.indexOf("gate/") === 0 ? "stacked" : "line",
               band: false }, true);
  });

  // ---- live: append the steps written since the last one shown
  if (script && script.dataset.live === "true") {
    var url = script.dataset.metricsUrl;
    var run = page.metrics;
    var busy = false;
    var timer = setInterval(function () {
      if (busy) return;
      busy = true;
      var after = run.last_step === null ? "" : "?after=" + run.last_step;
      fetch(url + after).then(function (r) { return r.ok ? r.json() : null; }).then(function (more) {
        busy = false;
        if (!more) return;
        if (more.steps.length) {
          var n = run.steps.length;
          Object.keys(more.columns).forEach(function (key) {
            if (!run.columns[key]) {
              run.columns[key] = new Array(n).fill(null);
              var group = choice.querySelector('optgroup[label="' + (key.indexOf("/") > 0 ? key.split("/")[0] : "other") + '"]');
              var option = document.createElement("option");
              option.textContent = key;
              (group || choice).appendChild(option);
            }
          });
          Object.keys(run.columns).forEach(function (key) {
            var add = more.columns[key] || new Array(more.steps.length).fill(null);
            Array.prototype.push.apply(run.columns[key], add);
          });
          ["steps", "wall_s", "tokens"].forEach(function (k) { Array.prototype.push.apply(run[k], more[k]); });
          Array.prototype.push.apply(run.evals, more.evals);
          run.last_step = more.last_step;
          document.querySelector('[data-testid="last-step"]').textContent = String(run.last_step);
          redraw();
        }
        if (more.status !== "running") {
          clearInterval(timer);
          var pill = document.querySelector('[data-testid="status"]');
          pill.textContent = more.status;
          pill.className = "pill status-" + more.status;
        }
      }).catch(function () { busy = false; });
    }, page.poll_s * 1000);
  }
})();
