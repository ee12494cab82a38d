"""JAX's persistent compilation cache (MaxText turns it on) must not change the analysis.

Its key leaves XLA's dump options out, so a cache hit would skip the passes the analysis
reads. The analysis compile bypasses the cache, reading and writing, and gets the same
answer every time; the user's own compiles keep using it.
"""

from __future__ import annotations

import os

import jax
import pytest

import shardlint
from shardlint.examples import steps

from support import context_mesh, example_analyses


@pytest.fixture
def persistent_cache(tmp_path):
    from jax.experimental.compilation_cache import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_enable_compilation_cache")
    before = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
    yield tmp_path / "cache"
    for n, v in before.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


def _signature(analysis: shardlint.Analysis):
    return ([(f.op, f.axes, f.source, f.collectives) for f in analysis.findings],
            [(c.kind, c.axes, c.shape, c.cause) for c in analysis.collectives])


def test_same_analysis_twice_with_the_cache_on(persistent_cache):
    fn, args = steps.make_step(context_mesh(4), example_analyses.SIZES)
    first = shardlint.analyze(fn, *args)
    second = shardlint.analyze(fn, *args)
    assert first.findings and _signature(first) == _signature(second)
    assert _signature(first) == _signature(example_analyses.analysis("make_step", 4))
    # The analysis wrote nothing into the user's cache ...
    assert not persistent_cache.exists() or not any(persistent_cache.iterdir())
    # ... and the user's own compiles still use it.
    jax.jit(fn).lower(*args).compile()
    assert any(persistent_cache.iterdir())


def test_cli_analyze_twice_and_report_with_the_cache_on(tmp_path, run_cli, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    target = "shardlint.examples.steps:make_step"
    outputs = []
    for _ in range(2):
        done = run_cli("analyze", target, "--mesh", "data=2,context=4")
        assert done.returncode == 1, done.stderr  # findings, not an input error
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1] and "finding(s)" in outputs[0]
    page = tmp_path / "report.html"
    done = run_cli("report", target, "--mesh", "data=2,context=4", "--out", str(page))
    assert done.returncode in (0, 1), done.stderr
    assert page.exists() and os.path.getsize(page) > 0
