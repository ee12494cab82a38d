"""The compiler's refusal of a step for lack of memory, read into its figures (the messages
of libtpu 0.0.42 and 0.0.50, as they came), and what a refused step's analysis says. The
TPU compiles that produce them are tests/tpu/test_no_fit.py."""

from __future__ import annotations

import dataclasses

import pytest

from shardlint.analyzer import Analysis, Memory, fit_of
from shardlint.analyzer.compile._compile import no_fit
from shardlint.analyzer._model import NoFit

GIB = 2 ** 30
LIBTPU_50 = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
             "required for HLO temporaries (105.24G) exceeds available HBM (95.73G). HLO module: "
             "jit_maxtext_train_step.\nSee https://openxla.org/xla/errors/error_1000 for more details.")
LIBTPU_42 = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
             "temporaries (35.29G) exceeds available HBM (15.75G).")


@pytest.mark.parametrize("text, needed, available", [(LIBTPU_50, 105.24, 95.73), (LIBTPU_42, 35.29, 15.75)])
def test_the_compilers_figures_are_read(text, needed, available):
    refused = no_fit(RuntimeError(text))
    assert refused.needed_bytes == int(needed * GIB) and refused.available_bytes == int(available * GIB)
    assert refused.message.startswith(("E1000: CompileTimeHbmOom: Ran out", "Ran out of memory"))
    assert "\n" not in refused.message


def test_other_errors_are_not_a_refusal_for_memory():
    assert no_fit(RuntimeError("INVALID_ARGUMENT: bad sharding")) is None
    vague = no_fit(RuntimeError("RESOURCE_EXHAUSTED: out of vmem"))
    assert vague == NoFit(needed_bytes=None, available_bytes=None, message="out of vmem")


def _refused_analysis() -> Analysis:
    memory = Memory(argument_bytes=GIB, output_bytes=GIB, temp_bytes=104 * GIB, alias_bytes=GIB,
                    peak_bytes=None, flops=None)
    return Analysis(mesh={"fsdp": 8, "context": 8}, memory=memory, collectives=(), findings=(), requested=(),
                    versions={}, partitioner="shardy", platform="tpu", topology="v5p:4x4x4",
                    does_not_fit=no_fit(RuntimeError(LIBTPU_50)))


def test_a_refused_step_does_not_fit_whatever_the_limit_and_says_the_compilers_figures():
    analysis = _refused_analysis()
    for limit in (None, 1000.0):
        fit = fit_of(analysis, limit)
        assert not fit.fits
        assert fit.need_bytes == int(105.24 * GIB) and fit.limit_bytes == int(95.73 * GIB)
        assert fit.line() == ("does not fit: the compiler refused the step for lack of memory: needs 105.24 GiB "
                              "of temporaries > 95.73 GiB available (its own figures); its buffer assignment "
                              "holds arguments 1.00 GiB + outputs 1.00 GiB + temp 104.00 GiB per device")
    assert fit_of(dataclasses.replace(analysis, does_not_fit=None)).fits is False   # 105 GiB > 95


def test_the_refusal_round_trips_through_json():
    analysis = _refused_analysis()
    doc = analysis.to_json()
    assert doc["does_not_fit"]["needed_bytes"] == int(105.24 * GIB)
    assert Analysis.from_json(doc) == analysis
