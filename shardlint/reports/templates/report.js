/* shardlint report: sort, filter and paginate the collective table. Plain JS, no libraries.
   Rows are rendered on the server; this only chooses which of them sit in the tbody. */
(function () {
  "use strict";
  document.documentElement.classList.remove("no-js");
  var table = document.getElementById("collectives-table");
  if (!table) { return; }
  var body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.rows);
  var haystack = rows.map(function (r) { return (r.textContent + " " + r.cells[r.cells.length - 1].title).toLowerCase(); });
  var heads = Array.prototype.slice.call(table.tHead.rows[0].cells);
  var statusRank = { "new": 0, "changed": 1, "gone": 2, "same": 3 };
  var $ = function (id) { return document.getElementById(id); };
  var state = { words: [], kind: "", status: "", col: -1, dir: 1, page: 0, size: 50 };
  var keys = {};

  function sortKey(col) {
    if (!keys[col]) {
      var type = heads[col].getAttribute("data-sort");
      keys[col] = rows.map(function (r) {
        var cell = r.cells[col];
        if (type === "num") {
          return Math.max(parseFloat(cell.getAttribute("data-before")) || 0, parseFloat(cell.getAttribute("data-after")) || 0);
        }
        if (type === "status") { var s = statusRank[r.getAttribute("data-status")]; return s === undefined ? 9 : s; }
        return cell.textContent.trim().toLowerCase();
      });
    }
    return keys[col];
  }

  function visible() {
    var hits = [];
    for (var i = 0; i < rows.length; i++) {
      var r = rows[i];
      if (state.kind && r.getAttribute("data-kind") !== state.kind) { continue; }
      if (state.status && r.getAttribute("data-status") !== state.status) { continue; }
      var ok = true;
      for (var w = 0; w < state.words.length && ok; w++) { ok = haystack[i].indexOf(state.words[w]) >= 0; }
      if (ok) { hits.push(i); }
    }
    if (state.col >= 0) {
      var k = sortKey(state.col);
      hits.sort(function (a, b) { return k[a] < k[b] ? -state.dir : k[a] > k[b] ? state.dir : a - b; });
    }
    return hits;
  }

  function render() {
    var hits = visible();
    var size = state.size || hits.length || 1;
    var pages = Math.max(1, Math.ceil(hits.length / size));
    state.page = Math.min(state.page, pages - 1);
    var start = state.page * size;
    var frag = document.createDocumentFragment();
    hits.slice(start, start + size).forEach(function (i) { frag.appendChild(rows[i]); });
    body.textContent = "";
    body.appendChild(frag);
    $("c-info").textContent = hits.length
      ? (start + 1) + "–" + Math.min(start + size, hits.length) + " of " + hits.length + (hits.length !== rows.length ? " (of " + rows.length + ")" : "")
      : "no collective matches";
    $("c-prev").disabled = state.page === 0;
    $("c-next").disabled = state.page >= pages - 1;
    heads.forEach(function (h, i) {
      h.classList.toggle("sorted-asc", i === state.col && state.dir > 0);
      h.classList.toggle("sorted-desc", i === state.col && state.dir < 0);
    });
    Array.prototype.forEach.call(document.querySelectorAll(".diff button"), function (b) {
      b.classList.toggle("active", b.getAttribute("data-status") === state.status);
    });
    return hits;
  }

  var timer = null;
  $("c-filter").addEventListener("input", function (e) {
    clearTimeout(timer);
    timer = setTimeout(function () {
      state.words = e.target.value.toLowerCase().split(/\s+/).filter(Boolean);
      state.page = 0; render();
    }, 80);
  });
  $("c-kind").addEventListener("change", function (e) { state.kind = e.target.value; state.page = 0; render(); });
  $("c-size").addEventListener("change", function (e) { state.size = parseInt(e.target.value, 10); state.page = 0; render(); });
  $("c-prev").addEventListener("click", function () { state.page -= 1; render(); });
  $("c-next").addEventListener("click", function () { state.page += 1; render(); });
  heads.forEach(function (h, i) {
    if (!h.getAttribute("data-sort")) { return; }
    h.addEventListener("click", function () {
      /* a new column sorts numbers largest first and text A to Z; a second click reverses */
      state.dir = state.col === i ? -state.dir : (h.getAttribute("data-sort") === "num" ? -1 : 1);
      state.col = i; state.page = 0; render();
    });
  });
  Array.prototype.forEach.call(document.querySelectorAll(".diff button"), function (b) {
    b.addEventListener("click", function () {
      var s = b.getAttribute("data-status");
      state.status = state.status === s ? "" : s; state.page = 0; render();
    });
  });

  /* A link from a finding to a collective: show the page that holds its row. */
  function reveal() {
    var id = decodeURIComponent(location.hash.slice(1));
    var at = -1;
    for (var i = 0; i < rows.length; i++) { if (rows[i].id === id) { at = i; break; } }
    if (at < 0) { return; }
    state.words = []; state.kind = ""; state.status = "";
    $("c-filter").value = ""; $("c-kind").value = "";
    var hits = visible();
    var size = state.size || hits.length || 1;
    state.page = Math.floor(hits.indexOf(at) / size);
    render();
    var row = rows[at];
    row.classList.remove("flash"); void row.offsetWidth; row.classList.add("flash");
    row.scrollIntoView({ block: "center" });
  }
  window.addEventListener("hashchange", reveal);
  render();
  if (location.hash) { reveal(); }
})();
