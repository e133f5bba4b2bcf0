// rollmarket marketplace page: draws the page's record (embedded as JSON) into tables and Chart.js
// charts, and on a served page re-reads the .json twin every refresh_s seconds without reloading.
(function () {
  "use strict";
  const PALETTE = ["#2166ac", "#b2182b", "#1a7f37", "#9a6700", "#6a3d9a", "#00838f", "#e7298a", "#66a61e"];
  const TIERS = { fresh: "#1a7f37", replay: "#9a6700", quarantine: "#b42318" };
  const charts = {};
  const script = document.currentScript;

  function el(tag, text) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "—";
    return typeof value === "number" && !Number.isInteger(value) ? value.toFixed(digits ?? 3) : String(value);
  }
  function fill(testid, rows) {
    const body = document.querySelector(`[data-testid="${testid}"] tbody`);
    body.replaceChildren(...rows.map((cells) => {
      const tr = el("tr");
      cells.forEach((c) => tr.appendChild(el("td", c)));
      return tr;
    }));
    if (!rows.length) {
      const tr = el("tr"), td = el("td", "none");
      td.className = "empty";
      td.colSpan = body.parentElement.querySelectorAll("thead th").length || 2;
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }
  function counts(obj) {
    return Object.entries(obj).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  }
  function label(iso) {
    return iso.slice(11, 19);
  }
  function chart(id, type, labels, datasets, stacked, yTitle) {
    if (!window.Chart) return;
    const canvas = document.getElementById(id);
    if (charts[id]) {
      charts[id].data.labels = labels;
      charts[id].data.datasets = datasets;
      charts[id].update("none");
      return;
    }
    charts[id] = new window.Chart(canvas, {
      type: type,
      data: { labels: labels, datasets: datasets },
      options: {
        animation: false, responsive: false,
        scales: { x: { stacked: stacked }, y: { stacked: stacked, beginAtZero: true, title: { display: true, text: yTitle } } },
        plugins: { legend: { display: stacked || datasets.length > 1 } },  // a stack says what its colours are
      },
    });
  }
  function stacks(timeline, field, keys, colour) {
    return keys.map((key, i) => ({
      label: key, backgroundColor: colour(key, i), data: timeline.map((b) => b[field][key] || 0),
    }));
  }

  function draw(page) {
    const r = page.report;
    const decided = Object.values(r.decisions).reduce((a, b) => a + b, 0);
    fill("market-headline", [
      ["active / published policy", `${fmt(r.active_version)} / ${fmt(r.published_version)}`],
      ["workers", r.workers.length],
      ["accepted groups", r.accepted_groups],
      ["accepted tokens", r.accepted_tokens],
      ["accepted tokens/s", fmt(r.accepted_tokens_per_s, 1)],
      ["decisions", `${decided} (${counts(r.decisions).map(([k, v]) => `${k} ${v}`).join(", ") || "none"})`],
      ["reload-ack latency mean / max (s)", `${fmt(r.reload_latency_mean_s)} / ${fmt(r.reload_latency_max_s)}`],
      ["trainer idle fraction", r.trainers.map((t) => `${t.trainer_id} ${fmt(t.idle_fraction)}`).join(", ") || "—"],
    ]);
    document.querySelectorAll('[data-testid="market-headline"] td:last-child').forEach((td, i) => {
      td.dataset.field = ["versions", "workers", "accepted_groups", "accepted_tokens", "tokens_per_s", "decisions",
        "reload_latency", "idle"][i];
    });
    fill("market-workers", r.workers.map((w) => [
      w.worker_id, w.status, `${w.engine_name} ${w.engine_version} · ${w.device_count}× ${w.device_type} · ${w.region}`,
      w.precision_classes.join(", "), w.engine_fingerprint.slice(0, 12), fmt(w.quality), fmt(w.price_hint, 2),
      `${w.leases} (${w.active_leases} active)`, w.accepted, w.rejected, w.accepted_tokens,
      counts(w.decisions).map(([k, v]) => `${k} ${v}`).join(", ") || "—",
    ]));
    fill("market-fingerprints", (r.fingerprints || []).map((f) => [
      f.engine_fingerprint.slice(0, 12), fmt(f.quality), f.feedback_count, f.rejected_count, f.accepted,
      f.workers.join(", ") || "—",
    ]));
    fill("market-submission-rejections", counts(r.submission_rejections));
    fill("market-gate-rejections", counts(r.gate_rejections));
    fill("market-reloads", r.reload_acks.map((a) => [a.worker_id, a.policy_version, fmt(a.seconds)]));
    fill("market-trainers", r.trainers.map((t) => [t.trainer_id, t.groups, fmt(t.span_s), fmt(t.busy_s), fmt(t.idle_fraction)]));
    const labels = r.timeline.map((b) => label(b.start));
    const workers = [...new Set(r.timeline.flatMap((b) => Object.keys(b.by_worker)))].sort();
    const tiers = Object.keys(TIERS).filter((t) => r.timeline.some((b) => b.by_tier[t]));
    chart("chart-by-worker", "bar", labels, stacks(r.timeline, "by_worker", workers, (k, i) => PALETTE[i % PALETTE.length]), true, "decisions");
    chart("chart-by-tier", "bar", labels, stacks(r.timeline, "by_tier", tiers, (k) => TIERS[k]), true, "decisions");
    chart("chart-tokens", "bar", labels, [{ label: "accepted tokens/s", backgroundColor: PALETTE[0],
      data: r.timeline.map((b) => b.accepted_tokens / r.bucket_s) }], false, "tokens/s");
    chart("chart-lag", "bar", r.lag_histogram.map((b) => String(b.lag)), [{ label: "groups", backgroundColor: PALETTE[3],
      data: r.lag_histogram.map((b) => b.groups) }], false, "groups");
    const updated = document.querySelector('[data-testid="market-updated"]');
    if (updated) updated.textContent = r.generated_at;
    document.body.dataset.drawn = r.generated_at;
  }

  draw(JSON.parse(document.getElementById("market-data").textContent));
  const twin = script && script.dataset.live;
  if (twin) {
    const page = JSON.parse(document.getElementById("market-data").textContent);
    setInterval(() => {
      fetch(twin, { cache: "no-store" })
        .then((response) => (response.ok ? response.json() : Promise.reject(response.status)))
        .then(draw)
        .catch(() => { /* a missed refresh keeps the last numbers; the next one tries again */ });
    }, page.refresh_s * 1000);
  }
})();
