"""A step with thousands of collectives still renders small and grouped.

The synthetic program (conftest's `synthetic`) is what an unrolled 48-layer model looks
like to the analyzer: ~5000 collectives that group into a few hundred rows. How long the
render takes is a benchmark's (benchmarks/report_render.py: median CPU seconds), not a
bound here, where a busy machine's seconds fail it (issue 53): the work is bounded by the
rows the page holds, one per collective key.
"""

from __future__ import annotations

import collections

from shardlint.gate import collective_key
from shardlint.reports import render_html


def test_five_thousand_collectives_render_grouped_in_under_5mb(pair, parse, synthetic):
    before = synthetic(pair[0])
    after = synthetic(pair[1], drop=5)
    assert len(before.collectives) >= 4900
    text = render_html(before, after, title="synthetic", root="/srv/project")
    size = len(text.encode("utf-8"))
    assert size < 5 * 1024 * 1024, f"page is {size / 2**20:.2f} MiB"

    page = parse(text)
    rows = page.find("table", id="collectives-table").find_all("tr", data_status=True)
    keys = collections.Counter(collective_key(c, "/srv/project") for c in before.collectives)
    assert len(rows) == len(keys) < 500  # grouped: one row per key
    counts = [int(r.find("td", data_col="count").attrs["data-before"]) for r in rows]
    assert sum(counts) == len(before.collectives) and max(counts) == 48
    after_counts = sum(int(r.find("td", data_col="count").attrs["data-after"]) for r in rows)
    assert after_counts == len(after.collectives)
    gone = page.find(data_figure="diff-gone").attrs["data-value"]
    assert int(gone) == len(set(keys) - {collective_key(c, "/srv/project") for c in after.collectives})
