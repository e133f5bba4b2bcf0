// rollmarket training run page: curves of metrics.jsonl against step, wall time or tokens, with the
// held-out interval band, a metric chooser, EMA smoothing, log scale, overlays and (for running runs
// on a server, the page's own and its overlays) live updates from /train/<id>/metrics.json?after=<step>.
// The page carries only the default charts' columns: a chosen metric is fetched from
// /train/<id>/columns.json?keys=K, or in a static export loaded as the script columns/<key>.js (a page
// opened from file:// cannot fetch). No build step, no network.
(function () {
  "use strict";
  var source = document.getElementById("train-data");
  var host = document.getElementById("charts");
  if (!source || !host || !window.Chart) return;
  var page = JSON.parse(source.textContent);
  var sources = JSON.parse(document.getElementById("train-sources").textContent);
  var script = document.currentScript;
  var isStatic = script && script.dataset.static === "true";
  var runs = [page.metrics].concat(page.overlays);
  var byId = {};
  runs.forEach(function (run) { byId[run.run_id] = run; });
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

  // A canvas 426 px wide cannot show 10,000 bars a tier, and drawing them took chart.js ~0.6 s a
  // redraw: past MAX_BARS steps, each bar sums the decisions of `stepsPerBar()` consecutive steps.
  var MAX_BARS = 400;
  function stepsPerBar() {
    return Math.max(1, Math.ceil(Math.max.apply(null, runs.map(function (run) { return run.steps.length; })) / MAX_BARS));
  }
  function bars(points) {
    var k = stepsPerBar();
    if (k === 1) return points;
    var out = [];
    for (var i = 0; i < points.length; i += k) {
      var y = 0;
      points.slice(i, i + k).forEach(function (p) { y += p.y; });
      out.push({ x: points[i].x, y: y });
    }
    return out;
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
          out.push({ type: "bar", label: label, data: bars(linePoints(run, key)), backgroundColor: colour + (r ? "88" : ""),
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
      // Lines hold {x, y} points already sorted by x: chart.js may skip parsing them and draws a
      // 10,000-step line decimated to what its pixels can show (min-max keeps every spike).
      animation: false, responsive: false, parsing: panel.kind === "stacked", normalized: true,
      plugins: {
        decimation: { enabled: panel.kind !== "stacked", algorithm: "min-max" },
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
    var note = document.createElement("small");
    note.className = "muted";
    note.setAttribute("data-testid", "bar-steps");
    if (panel.kind === "stacked") caption.appendChild(note);
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
    charts.push({ panel: panel, chart: chart, figure: figure, note: note });
    describe(charts[charts.length - 1]);
  }
  function describe(c) {
    var k = stepsPerBar();
    c.note.textContent = k > 1 ? " (each bar sums " + k + " steps)" : "";
  }

  function redraw() {
    charts.forEach(function (c) {
      c.chart.data.datasets = datasets(c.panel);
      c.chart.options = options(c.panel);
      c.chart.update();
      describe(c);
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
    var id = "custom-" + custom;
    load(key).then(function () {
      addChart({ id: id, title: key, keys: [key], kind: key.indexOf("gate/") === 0 ? "stacked" : "line",
                 band: false }, true);
    });
  });

  // ---- metrics the page did not carry: fetched (or, from files, loaded as scripts) when chosen
  function slug(name) {  // pages.slug: a character other than [A-Za-z0-9_.-] as ~XX per UTF-8 byte
    var out = "";
    Array.from(name).forEach(function (ch) {
      if (/[A-Za-z0-9_.-]/.test(ch)) { out += ch; return; }
      new TextEncoder().encode(ch).forEach(function (b) { out += "~" + (b < 16 ? "0" : "") + b.toString(16); });
    });
    return out;
  }
  function merge(picked) {  // a PickedColumns record: whole columns, cut to the steps this page holds
    var run = byId[picked.run_id];
    if (!run) return;
    Object.keys(picked.columns).forEach(function (key) {
      var column = picked.columns[key].slice(0, run.steps.length);
      while (column.length < run.steps.length) column.push(null);
      run.columns[key] = column;
    });
  }
  window.rollmarketColumns = merge;  // what an exported columns/<key>.js calls
  function loadScript(src) {
    return new Promise(function (resolve) {
      var tag = document.createElement("script");
      tag.src = src;
      tag.onload = tag.onerror = function () { tag.remove(); resolve(); };  // no file: the run lacks the key
      document.head.appendChild(tag);
    });
  }
  function load(key) {
    return Promise.all(runs.filter(function (run) { return !run.columns[key]; }).map(function (run) {
      var where = sources[run.run_id].columns;
      var got = isStatic ? loadScript(where + slug(key) + ".js")
        : fetch(where + "?keys=" + encodeURIComponent(key)).then(function (r) { return r.ok ? r.json() : null; })
            .then(function (picked) { if (picked) merge(picked); }).catch(function () {});
      return got.then(function () {
        // A run without the key draws nothing, and its new steps' values (if it gains the key) come with the poll.
        if (!run.columns[key]) run.columns[key] = new Array(run.steps.length).fill(null);
      });
    }));
  }

  // ---- live: each running run (the page's own and its overlays) appends the steps written since
  function offer(names) {  // keys the run gained join the chooser
    var have = {};
    Array.from(choice.options).forEach(function (o) { have[o.value] = true; });
    names.filter(function (key) { return !have[key]; }).forEach(function (key) {
      var group = choice.querySelector('optgroup[label="' + (key.indexOf("/") > 0 ? key.split("/")[0] : "other") + '"]');
      var option = document.createElement("option");
      option.textContent = key;
      (group || choice).appendChild(option);
    });
  }
  function append(run, more) {
    var n = run.steps.length;
    Object.keys(more.columns).forEach(function (key) {
      if (!run.columns[key]) run.columns[key] = new Array(n).fill(null);
    });
    Object.keys(run.columns).forEach(function (key) {
      var add = more.columns[key] || new Array(more.steps.length).fill(null);
      Array.prototype.push.apply(run.columns[key], add);
    });
    ["steps", "wall_s", "tokens"].forEach(function (k) { Array.prototype.push.apply(run[k], more[k]); });
    Array.prototype.push.apply(run.evals, more.evals);
    run.last_step = more.last_step;
  }
  function follow(run) {
    var main = run === page.metrics;
    var busy = false;
    var timer = setInterval(function () {
      if (busy) return;
      busy = true;
      // Only the columns this page holds: a chart added later fetches its whole column first.
      var query = Object.keys(run.columns).map(function (k) { return "keys=" + encodeURIComponent(k); });
      if (run.last_step !== null) query.unshift("after=" + run.last_step);
      fetch(sources[run.run_id].metrics + (query.length ? "?" + query.join("&") : ""))
        .then(function (r) { return r.ok ? r.json() : null; }).then(function (more) {
          busy = false;
          if (!more) return;
          if (main) offer(more.names);
          if (more.steps.length) {
            append(run, more);
            if (main) document.querySelector('[data-testid="last-step"]').textContent = String(run.last_step);
            redraw();
          }
          if (more.status !== "running") {
            clearInterval(timer);
            if (!main) return;
            var pill = document.querySelector('[data-testid="status"]');
            pill.textContent = more.status;
            pill.className = "pill status-" + more.status;
          }
        }).catch(function () { busy = false; });
    }, page.poll_s * 1000);
  }
  if (!isStatic) runs.filter(function (run) { return run.status === "running"; }).forEach(follow);
})();
