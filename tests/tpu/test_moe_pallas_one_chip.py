"""The one-chip check of ShardedRoutedMoE's Pallas path (`moe_pallas_one_chip.py`, run on a
TPU chip by hand) kept working without one: on the CPU it skips, and in Pallas interpret
mode it passes; with libtpu its programs, and the same layer's on a multi-chip mesh,
compile for a TPU with the Mosaic kernels in them (`python -m pytest -q -m tpu -n 0`).
"""

from __future__ import annotations

import pytest
from jax.experimental.pallas import tpu as pltpu

import moe_pallas_one_chip as one_chip
from shardlint.moe.kernels import _plan as _gmm_plan


def test_without_a_tpu_it_prints_one_skip_line(capsys):
    assert one_chip.main([]) == 0
    assert capsys.readouterr().out.startswith("skip: no TPU")


def test_in_interpret_mode_the_check_passes(capsys):
    """The case whose rows and weights vary over the mesh axes, one device's values at a
    time through the kernels (the others: `-m slow` runs them all)."""
    assert one_chip.main(["--interpret", "--case", "tokens over data x context"]) == 0
    out = capsys.readouterr().out
    assert "PASS: tokens over data x context" in out and "FAIL" not in out


@pytest.mark.slow
def test_in_interpret_mode_every_case_passes(capsys):
    assert one_chip.main(["--interpret"]) == 0
    assert capsys.readouterr().out.count("PASS: ") == len(one_chip.CASES)


@pytest.mark.tpu
def test_the_one_chip_programs_compile_for_a_tpu(capsys):
    assert one_chip.compile_only("v5e:1x1") == []


@pytest.mark.tpu
def test_the_pallas_path_compiles_on_a_multi_chip_mesh(capsys):
    """8 chips: tokens over data x context (2 x 4), and an expert axis that shards the
    expert weights but no tokens (2 x 2 x 2). The expert weights whole along D
    (`weight_axes=()`), as the Pallas path needs."""
    shapes = {"tokens over data x context": (2, 4), "experts over an expert axis": (2, 2, 2)}
    assert one_chip.compile_only("v5e:2x4", shapes, names=tuple(shapes), weight_axes=()) == []


@pytest.mark.tpu
@pytest.mark.parametrize("topology, chip, limit_mib", [
    ("v4:2x2x1", "TPU_V4", 16), ("v5e:2x2", "TPU_V5E", 64), ("v5p:2x2x1", "TPU_V5P", 64),
    ("v6e:2x2", "TPU_V6E", 64)])
def test_at_issue_43s_sizes_the_kernels_fit_each_chips_vmem(topology, chip, limit_mib):
    """At issue 43's sizes (D=2048, F=1024, 64 experts, top-8), on a 2 x 2 mesh of each
    chip, at its limit (`_plan.vmem_limit_of` of its VMEM per core, JAX's
    `pltpu.get_tpu_info`: 16 MiB on a v4, where the kernels' blocks and the combine's token
    tiles shrink to fit; at 28 MiB, the v4's limit before, libtpu refused the SwiGLU: "Used
    17.68M of 16.00M vmem")."""
    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, chip), 1)
    limit = _gmm_plan.vmem_limit_of(info.vmem_capacity_bytes)
    assert limit == limit_mib * 2 ** 20
    sizes = one_chip.Sizes(batch=2, seq=4096, emb=2048, mlp=1024, experts=64, top_k=8)
    shapes = {"tokens over data x context": (2, 2)}
    assert one_chip.compile_only(topology, shapes, names=tuple(shapes), sizes=sizes,
                                 vmem_limit=limit, weight_axes=()) == []
