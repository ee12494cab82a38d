"""TPU AOT tests: a test marked `tpu` is skipped, with the reason, where libtpu is absent
or is not the build the installed jax pins (a mismatched libtpu fails inside the
compiler). Unmarked tests here check the libtpu and memory-fit logic without libtpu."""

from __future__ import annotations

import pytest

from shardlint.analyzer.compile._topology import LibtpuError, check_libtpu


def pytest_collection_modifyitems(config, items):
    try:
        check_libtpu()
        return
    except LibtpuError as e:
        skip = pytest.mark.skip(reason=f"needs a matching libtpu: {e}")
    for item in items:
        if item.get_closest_marker("tpu") is not None:
            item.add_marker(skip)
