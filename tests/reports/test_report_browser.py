"""The page in a real browser: headless Chromium opens it from file://, under its own CSP.

Skipped where Chromium is not installed (`apt-get install -y chromium`), except in CI, which
installs it (`.ci/run`) and fails the tests without it. The screenshot
is decoded with zlib and numpy (no Pillow) and must show a real page, not a blank
one; the DOM dump shows the table script ran (it is inline, so the CSP allowed it) and
paginated a large table; a driver script clicks through sort, the kind and text filters
and the pages as a reader does, and each view must be the rows the server rendered, in
the order the clicks ask for. At 1280, 1400 and 1920 px wide the box of every text drawn is
measured: none may overlap another, and a text cut off must be readable whole on hover or by
scrolling.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest

from shardlint.analyzer import Source
from shardlint.reports import render_html, write_html

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
# Skipped on a developer's machine without Chromium; in CI (.ci/run installs it) never.
pytestmark = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                                reason="headless Chromium is not installed (/usr/bin/chromium); "
                                       "apt-get install -y chromium to run this test")
BEFORE_RGB = bytes((0xD9, 0x48, 0x0F))  # --before in report.css: chart line, finding badges


def _chromium(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("CI runs the browser tests: headless Chromium must be installed "
                    "(.ci/run installs it with apt-get install -y chromium)")
    profile = tmp_path / "profile"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--hide-scrollbars", f"--user-data-dir={profile}", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def decode_png(data: bytes) -> tuple[int, int, int, np.ndarray]:
    """(width, height, channels, pixels[h, w, c]) of an 8-bit, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    width, height, depth, colour, _, _, interlace = header
    c = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    assert depth == 8 and not interlace, f"unsupported PNG (depth {depth}, interlace {interlace})"
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(height, width * c + 1)
    out = np.zeros((height, width * c), np.uint8)
    prev = np.zeros(width * c, np.uint8)
    for y in range(height):
        f, line = raw[y, 0], raw[y, 1:]
        if f == 0:
            row = line.copy()
        elif f == 1:  # Sub: a running sum per channel
            row = (np.cumsum(line.reshape(width, c), axis=0, dtype=np.uint64) & 255).astype(np.uint8).ravel()
        elif f == 2:  # Up
            row = line + prev
        else:  # Average, Paeth: each byte depends on the one to its left
            row, cur, up = bytearray(line.tobytes()), line.tolist(), prev.tolist()
            for i in range(width * c):
                a = row[i - c] if i >= c else 0
                b = up[i]
                if f == 3:
                    row[i] = (cur[i] + (a + b) // 2) & 255
                else:
                    cc = up[i - c] if i >= c else 0
                    p = a + b - cc
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - cc)
                    row[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else cc)) & 255
            row = np.frombuffer(bytes(row), np.uint8)
        out[y] = prev = row
    return width, height, c, out.reshape(height, width, c)


def test_screenshot_shows_a_rendered_page(pair, sweep, tmp_path):
    page = write_html(*pair, path=str(tmp_path / "report.html"), sweep=sweep,
                      title="shardlint.examples.steps:make_step")
    png = tmp_path / "report.png"
    proc = _chromium(tmp_path, f"--screenshot={png}", "--window-size=1280,2000", f"file://{page}")
    assert png.exists(), proc.stderr[-2000:]
    width, height, channels, pixels = decode_png(png.read_bytes())
    assert (width, height) == (1280, 2000)
    pixels = {bytes(p) for p in pixels[:, :, :3].reshape(-1, 3)}
    assert len(pixels) > 200, f"only {len(pixels)} colours: the page looks blank"
    assert BEFORE_RGB in pixels, "the stylesheet's colours are missing: CSS did not apply"
    if os.environ.get("SHARDLINT_SCREENSHOT"):
        shutil.copy(png, os.environ["SHARDLINT_SCREENSHOT"])


def test_table_script_runs_under_the_csp_paginates_and_follows_links(pair, parse, synthetic, tmp_path):
    before, after = synthetic(pair[0]), synthetic(pair[1], drop=5)
    path = tmp_path / "big.html"
    path.write_text(render_html(before, after), encoding="utf-8")
    server_rows = parse(path.read_text(encoding="utf-8")).find("table", id="collectives-table").find_all("tr", id=True)
    target = server_rows[120].attrs["id"]  # on the third page of 50
    proc = _chromium(tmp_path, "--dump-dom", f"file://{path}#{target}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = parse(proc.stdout)
    assert "no-js" not in dom.find("html").classes()  # the inline script ran under the CSP
    table = dom.find("table", id="collectives-table")
    total = int(table.attrs["data-rows"])
    shown = [tr.attrs["id"] for tr in table.find("tbody").find_all("tr")]
    assert total == len(server_rows) > 150
    assert shown == [tr.attrs["id"] for tr in server_rows[100:150]] and target in shown
    assert dom.find(id="c-info").text() == f"101–150 of {total}"


# Clicks as a reader does, then writes what the table showed after each into the body.
_DRIVER = """<script>
window.addEventListener("load", function () {
  var ids = function () {
    return Array.prototype.map.call(document.querySelectorAll("#collectives-table tbody tr"),
                                    function (r) { return r.id; });
  };
  var info = function () { return document.getElementById("c-info").textContent; };
  var seen = {};
  document.querySelector("#collectives-table th.c-bytes").click();
  seen.by_bytes = ids(); seen.by_bytes_info = info();
  document.getElementById("c-next").click();
  seen.page_2 = ids(); seen.page_2_info = info();
  document.querySelector("#collectives-table th.c-bytes").click();
  seen.by_bytes_ascending = ids();
  var kind = document.getElementById("c-kind");
  kind.value = "all-gather"; kind.dispatchEvent(new Event("change"));
  seen.all_gathers = ids(); seen.all_gathers_info = info();
  kind.value = ""; kind.dispatchEvent(new Event("change"));
  var filter = document.getElementById("c-filter");
  filter.value = "mlp_7/"; filter.dispatchEvent(new Event("input"));
  setTimeout(function () {
    seen.filtered = ids(); seen.filtered_info = info();
    document.body.setAttribute("data-seen", JSON.stringify(seen));
  }, 500);
});
</script>"""


def test_sort_filter_and_pages_by_clicking_in_the_browser(pair, parse, synthetic, tmp_path):
    import json

    before, after = synthetic(pair[0]), synthetic(pair[1], drop=5)
    text = render_html(before, after)
    path = tmp_path / "clicked.html"
    path.write_text(text.replace("</body>", _DRIVER + "</body>"), encoding="utf-8")
    # The page's own rows, as the server rendered them, to know what each click must show.
    rows = parse(text).find("table", id="collectives-table").find_all("tr", id=True)
    total = len(rows)

    def moved(tr):
        cell = tr.find("td", data_col="bytes")
        return max(float(cell.attrs.get("data-before") or 0), float(cell.attrs.get("data-after") or 0))

    # Numbers sort largest first on the first click (ties keep the page's order).
    by_bytes = [tr.attrs["id"] for tr in sorted(rows, key=lambda tr: -moved(tr))]
    ascending = [tr.attrs["id"] for tr in sorted(rows, key=moved)]
    gathers = [tr.attrs["id"] for tr in rows if tr.attrs["data-kind"] == "all-gather"]
    mlp_7 = [tr.attrs["id"] for tr in rows if "mlp_7/" in (tr.text() + " " + tr.find_all("td")[-1].attrs.get("title", "")).lower()]
    assert total > 100 and 0 < len(gathers) < total and 0 < len(mlp_7) < total

    proc = _chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", f"file://{path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(parse(proc.stdout).find("body").attrs["data-seen"])
    assert seen["by_bytes"] == by_bytes[:50] and seen["by_bytes_info"] == f"1–50 of {total}"
    assert seen["page_2"] == by_bytes[50:100] and seen["page_2_info"] == f"51–100 of {total}"
    assert seen["by_bytes_ascending"] == ascending[:50]      # the second click reverses
    assert seen["all_gathers"] == sorted(gathers, key=ascending.index)[:50]   # still sorted, page 1
    assert seen["all_gathers_info"] == f"1–{min(50, len(gathers))} of {len(gathers)} (of {total})"
    assert seen["filtered"] == sorted(mlp_7, key=ascending.index)[:50]
    assert seen["filtered_info"].endswith(f"of {len(mlp_7)} (of {total})")


# Measures, after the page's own script ran, the box of every piece of text Chromium drew
# (each text node's client rects, cut to what its overflow-clipping ancestors show) and
# writes into the body: pairs of texts whose boxes overlap; texts cut off, and whether the
# rest is reachable (a title on the way up to the clip, or a clip that scrolls); graph labels
# that leave their node's box.
_BOXES = """<script>
window.addEventListener("load", function () {
  function box(r) { return {l: r.left, t: r.top, r: r.right, b: r.bottom}; }
  function meet(a, b) {
    var c = {l: Math.max(a.l, b.l), t: Math.max(a.t, b.t), r: Math.min(a.r, b.r), b: Math.min(a.b, b.b)};
    return (c.r > c.l && c.b > c.t) ? c : null;
  }
  function clipOf(el) {   // {box, by}: what the ancestors let show, and the innermost clip
    var clip = {l: -1e9, t: -1e9, r: 1e9, b: 1e9}, by = [];
    for (var a = el; a && a !== document.documentElement; a = a.parentElement) {
      var s = getComputedStyle(a), svg = a.tagName.toLowerCase() === "svg";
      if (svg || s.overflowX !== "visible" || s.overflowY !== "visible") {
        var r = a.getBoundingClientRect();
        clip = meet(clip, svg ? box(r) : {l: r.left + a.clientLeft, t: r.top + a.clientTop,
                      r: r.left + a.clientLeft + a.clientWidth, b: r.top + a.clientTop + a.clientHeight});
        by.push(a);
        if (!clip) break;
      }
    }
    return {box: clip, by: by};
  }
  function reachable(el, clips) {   // the whole text shows on hover or by scrolling
    for (var a = el; a; a = a.parentElement) {
      if (a.hasAttribute("title") || (a.firstElementChild && a.firstElementChild.tagName.toLowerCase() === "title")) return true;
      if (clips.indexOf(a) >= 0) {
        var s = getComputedStyle(a);
        return /auto|scroll/.test(s.overflowX + s.overflowY);
      }
    }
    return false;
  }
  function where(el) {
    var path = [];
    for (var a = el; a && path.length < 4 && a !== document.body; a = a.parentElement)
      path.push(a.tagName.toLowerCase() + (a.id ? "#" + a.id : "") +
                (a.getAttribute("class") ? "." + a.getAttribute("class").split(" ").join(".") : ""));
    return path.join(" < ");
  }
  var rects = [], cut = [], id = 0;
  var walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (var n = walker.nextNode(); n; n = walker.nextNode(), id++) {
    var el = n.parentElement;
    if (!n.textContent.trim() || el.closest("script, style, title")) continue;
    var range = document.createRange();
    range.selectNodeContents(n);
    var clip = clipOf(el), text = n.textContent.trim().slice(0, 80), parts = range.getClientRects();
    for (var i = 0; i < parts.length; i++) {
      var whole = box(parts[i]);
      if (whole.r - whole.l < 0.5 || whole.b - whole.t < 0.5) continue;
      var seen = clip.box ? meet(whole, clip.box) : null;
      if (!seen || seen.r - seen.l < whole.r - whole.l - 1 || seen.b - seen.t < whole.b - whole.t - 1)
        cut.push({text: text, where: where(el), reachable: reachable(el, clip.by)});
      if (seen) rects.push({id: id, c: seen, text: text, where: where(el)});
    }
  }
  var overlaps = [];
  rects.sort(function (a, b) { return a.c.t - b.c.t; });
  for (var i = 0; i < rects.length; i++) {
    for (var j = i + 1; j < rects.length && rects[j].c.t < rects[i].c.b; j++) {
      var m = rects[i].id !== rects[j].id && meet(rects[i].c, rects[j].c);
      if (m && m.r - m.l > 1 && m.b - m.t > 1)
        overlaps.push([rects[i].text, rects[i].where, rects[j].text, rects[j].where]);
    }
  }
  var outside = [];
  document.querySelectorAll("svg.graph g.node").forEach(function (g) {
    var frame = box(g.querySelector("rect").getBoundingClientRect());
    g.querySelectorAll("text").forEach(function (t) {
      var r = box(t.getBoundingClientRect());
      if (r.l < frame.l || r.r > frame.r || r.t < frame.t || r.b > frame.b)
        outside.push([g.getAttribute("data-node"), t.textContent]);
    });
  });
  document.body.setAttribute("data-boxes", JSON.stringify(
    {texts: rects.length, overlaps: overlaps, cut: cut, outside: outside,
     width: document.documentElement.clientWidth}));
});
</script>"""

LONG_SOURCE = Source("/home/someone/projects/a_long_project_name/src/models/mixture_of_experts/routed_layers.py",
                     1234, "routed_experts_forward")


def _long_sources(analysis):
    """The analysis with every other collective made at a deep path, as real projects are."""
    collectives = tuple(dataclasses.replace(c, source=LONG_SOURCE, stack=(LONG_SOURCE,)) if i % 2 else c
                        for i, c in enumerate(analysis.collectives))
    return dataclasses.replace(analysis, collectives=collectives)


@pytest.fixture(scope="module")
def laid_out_page(pair, sweep, tmp_path_factory):
    """The report of the example pair as users meet it: a sweep with a refused point, long
    source paths in the collectives table, findings with their graphs."""
    before, after = _long_sources(pair[0]), _long_sources(pair[1])
    points = [dict(p) for p in sweep["points"]]
    points[1] = {**points[1], "after": None, "refused": "float32[256,2,4,128] at shardlint/examples/"
                 "steps.py:110 has a second dimension that grows with the number of tokens"}
    text = render_html(before, after, sweep={"axis": sweep["axis"], "points": points},
                       title="shardlint.examples.steps:make_step")
    path = tmp_path_factory.mktemp("layout") / "report.html"
    path.write_text(text.replace("</body>", _BOXES + "</body>"), encoding="utf-8")
    return path


@pytest.mark.parametrize("width", [1280, 1400, 1920])
def test_no_text_overlaps_and_every_cut_text_can_be_read(laid_out_page, parse, tmp_path, width):
    import json

    proc = _chromium(tmp_path, f"--window-size={width},2000", "--virtual-time-budget=10000",
                     "--dump-dom", f"file://{laid_out_page}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    boxes = json.loads(parse(proc.stdout).find("body").attrs["data-boxes"])
    assert boxes["width"] == width and boxes["texts"] > 500
    assert boxes["overlaps"] == [], f"at {width} px these texts are drawn over each other: {boxes['overlaps'][:5]}"
    assert [c for c in boxes["cut"] if not c["reachable"]] == [], "cut off with no tooltip or scroll"
    # The source column shows its whole text, line number included.
    assert [c for c in boxes["cut"] if "td.mono.src" in c["where"]] == []
    assert boxes["outside"] == [], f"graph labels outside their node's box: {boxes['outside'][:5]}"
