"""How long the HTML report takes to render a step with thousands of collectives.

The tests' synthetic unrolled 48-layer model (`tests/support/synthetic.py`: about 5000
collectives that group into a few hundred rows), beside the example pair analyzed on 8
simulated CPU devices (data=2 x context=4), rendered before and after: median, min and max
CPU seconds of `render_html` over repeats, and the page's size. The test beside it
(tests/reports/test_report_scale.py) bounds the page's size and rows; the seconds are here,
where a busy machine does not fail a test.

    python benchmarks/report_render.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]   # run from a checkout; the tests' step libraries

import shardlint  # noqa: E402
from shardlint.examples import steps  # noqa: E402
from shardlint.reports import render_html  # noqa: E402
from support import build_mesh  # noqa: E402
from support.synthetic import many_collectives  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    mesh = build_mesh({"data": 2, "context": 4})
    before, after = (shardlint.analyze(fn, *fn_args) for fn, fn_args in
                     (steps.make_step(mesh), steps.make_per_shard_step(mesh)))
    before, after = many_collectives(before), many_collectives(after, drop=5)
    seconds, size = [], 0
    for _ in range(args.repeats):
        start = time.process_time()
        text = render_html(before, after, title="synthetic", root="/srv/project")
        seconds.append(time.process_time() - start)
        size = len(text.encode("utf-8"))
    print(f"render_html, {len(before.collectives)} -> {len(after.collectives)} collectives: "
          f"median {statistics.median(seconds):.2f} s CPU (min {min(seconds):.2f}, max {max(seconds):.2f}, "
          f"{args.repeats} runs); page {size / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
