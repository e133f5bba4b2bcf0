// rollmarket runs index: filter (kind, status, text) and sort (any column) in the page, no reload.
(function () {
  "use strict";
  var table = document.querySelector('[data-testid="runs"]');
  var form = document.querySelector('[data-testid="run-filters"]');
  if (!table || !form) return;
  var body = table.tBodies[0];
  var shown = form.querySelector('[data-testid="shown"]');
  var total = body.rows.length;

  function filter() {
    var kind = form.kind.value, status = form.status.value, q = form.q.value.trim().toLowerCase();
    var n = 0;
    Array.prototype.forEach.call(body.rows, function (row) {
      var ok = (!kind || row.dataset.kind === kind) && (!status || row.dataset.status === status) &&
               (!q || row.dataset.text.toLowerCase().indexOf(q) >= 0);
      row.hidden = !ok;
      if (ok) n++;
    });
    shown.textContent = n + " of " + total + " runs";
  }
  ["change", "input"].forEach(function (ev) { form.addEventListener(ev, filter); });

  var heads = table.tHead.rows[0].cells;
  function sortBy(index, descending) {
    var rows = Array.prototype.slice.call(body.rows);
    function key(row) { var c = row.cells[index]; return c ? c.dataset.value : undefined; }
    rows.sort(function (a, b) {
      var x = key(a), y = key(b);
      // Empty values go last whichever the direction, as on the server.
      if (!x && !y) return 0; if (!x) return 1; if (!y) return -1;
      var nx = Number(x), ny = Number(y);
      var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : (x < y ? -1 : x > y ? 1 : 0);
      return descending ? -c : c;
    });
    rows.forEach(function (row) { body.appendChild(row); });
    Array.prototype.forEach.call(heads, function (h, i) {
      h.classList.toggle("asc", i === index && !descending);
      h.classList.toggle("desc", i === index && descending);
    });
    table.dataset.sort = (descending ? "-" : "") + heads[index].dataset.key;
  }
  // The server's order (?sort=) shows on its column until a click sorts in the page.
  var initial = table.dataset.sort || "";
  Array.prototype.forEach.call(heads, function (head) {
    if (head.dataset.key && head.dataset.key === initial.replace(/^-/, "")) {
      head.classList.add(initial.charAt(0) === "-" ? "desc" : "asc");
    }
  });
  Array.prototype.forEach.call(heads, function (head, index) {
    if (!head.dataset.key) return;
    function click() { sortBy(index, head.classList.contains("asc")); }
    head.addEventListener("click", click);
    head.addEventListener("keydown", function (e) { if (e.key === "Enter") click(); });
  });
  filter();
})();
