// rollmarket rollouts table: column chooser (remembered in localStorage) and expandable long cells. No network.
(function () {
  "use strict";
  var table = document.querySelector("table.rollouts");
  if (!table) return;
  var KEY = "rollmarket.rollouts.columns";
  var defaults = JSON.parse(table.dataset.defaultColumns);
  var boxes = Array.prototype.slice.call(document.querySelectorAll(".chooser input[type=checkbox]"));

  function load() {
    try {
      var saved = JSON.parse(window.localStorage.getItem(KEY));
      if (Array.isArray(saved) && saved.length) return saved;
    } catch (e) { /* storage off or unreadable: the defaults */ }
    return defaults;
  }
  function save(cols) {
    try { window.localStorage.setItem(KEY, JSON.stringify(cols)); } catch (e) { /* not remembered */ }
  }
  function apply(cols) {
    var shown = {};
    cols.forEach(function (c) { shown[c] = true; });
    shown.row = true;  // the row number opens the generation: always there
    table.querySelectorAll("[data-col]").forEach(function (el) {
      el.classList.toggle("hidden-col", !shown[el.dataset.col]);
    });
    boxes.forEach(function (b) { b.checked = !!shown[b.value]; });
    // "more" only where a cell is cut (a hidden column is measured when it is shown again).
    table.querySelectorAll(".clip:not(.open)").forEach(function (clip) {
      if (clip.offsetParent !== null) clip.nextElementSibling.hidden = clip.scrollHeight <= clip.clientHeight + 1;
    });
  }
  boxes.forEach(function (b) {
    b.addEventListener("change", function () {
      var cols = boxes.filter(function (x) { return x.checked; }).map(function (x) { return x.value; });
      save(cols);
      apply(cols);
    });
  });
  var reset = document.querySelector("[data-testid=reset-columns]");
  if (reset) reset.addEventListener("click", function () {
    try { window.localStorage.removeItem(KEY); } catch (e) { /* nothing kept */ }
    apply(defaults);
  });
  apply(load());

  table.addEventListener("click", function (e) {
    var button = e.target.closest("button.expand");
    if (!button) return;
    var clip = button.previousElementSibling;
    var open = clip.classList.toggle("open");
    button.textContent = open ? "less" : "more";
  });
})();
