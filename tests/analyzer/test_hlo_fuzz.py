"""The HLO text parser on mutations of modules the installed JAX produced.

Dumps from other XLA builds, truncated files and hand-edited text reach the parser through
`--xla-dump`. Whatever a module holds, parsing it and reading it as the analysis does
(collectives, the propagated graph, every typed attribute view, loop trip counts) either
works or raises `HloParseError` naming the line; never another exception. The modules are
compiled here, once per session, from steps the other tests use (HLO text is never checked
in): the partitioned module and the module after sharding propagation of a shard_map step
with every collective kind, a scanned FSDP step (while loops) and the routed MoE (sort,
gather, scatter, top-k).

`PYTHONPATH=tests python -m analyzer.test_hlo_fuzz [N]` prints how many of N mutations
(random, not hypothesis) raise anything else, by exception type.
"""

from __future__ import annotations

import re
from typing import Callable

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlint import HloParseError
from shardlint.analyzer import MeshInfo
from shardlint.analyzer.explain._collectives import collectives_of
from shardlint.analyzer.graph._trips import executions, trip_count
from shardlint.analyzer.graph._graph import build_graph
from shardlint.analyzer.parse._hlo import Instruction, parse_hlo
from shardlint.examples import steps

from support import build_mesh, cause_steps, collective_steps

KINDS = ("truncate", "drop_lines", "duplicate_lines", "flip_bracket", "flip_quote",
         "digit_to_letter")
_CHARS = {"flip_bracket": "(){}[]", "flip_quote": "\"'", "digit_to_letter": "0123456789"}
_REPLACEMENTS = {"flip_bracket": ["", *"(){}[]"], "flip_quote": ["", '"', "'"],
                 "digit_to_letter": list("aexT")}
_VIEWS = tuple(name for name, value in vars(Instruction).items() if isinstance(value, property))


def _steps(mesh):
    return {
        "collectives": collective_steps.make_collectives_step(mesh, "context", "context", "data",
                                                              "data"),
        "scanned_fsdp": cause_steps.make_scanned_fsdp_step(mesh),
        "routed_moe": steps.make_step(mesh, steps.Sizes(batch=8)),
    }


def real_modules(dump_root) -> list[tuple[str, str, MeshInfo]]:
    """(name, HLO text, mesh) of each step's partitioned and propagated module."""
    mesh = build_mesh({"data": 2, "context": 4})
    info = MeshInfo.from_mesh(mesh)
    modules = []
    for name, (fn, args) in _steps(mesh).items():
        dump = dump_root / name
        compiled = jax.jit(fn).lower(*args).compile(compiler_options={
            "xla_dump_to": str(dump), "xla_dump_hlo_as_text": True,
            "xla_dump_hlo_pass_re": "shardy-xla|sharding-propagation"})
        propagated = sorted(p for p in dump.iterdir() if p.suffix == ".txt" and re.search(
            r"after_(shardy-xla|sharding-propagation)\.", p.name))
        modules.append((f"{name}.partitioned", compiled.as_text(), info))
        modules.append((f"{name}.propagated", propagated[-1].read_text(), info))
    return modules


def mutate(text: str, kind: str, pick: Callable[[int], int]) -> str:
    """`text` with one to three mutations of `kind`; `pick(n)` chooses in range(n)."""
    lines = text.splitlines(keepends=True)
    if kind == "truncate":
        i = pick(len(lines))
        return "".join(lines[:i]) + lines[i][:pick(len(lines[i]) + 1)]
    for _ in range(1 + pick(3)):
        if kind == "drop_lines" and lines:
            del lines[pick(len(lines))]
        elif kind == "duplicate_lines":
            i = pick(len(lines))
            lines.insert(i, lines[i])
        elif kind in _CHARS:
            # A line holding such a character, then one of its occurrences: short lines
            # (brackets of types, layouts, operand lists) are hit as often as metadata.
            chars = _CHARS[kind]
            holding = [i for i, line in enumerate(lines) if any(c in line for c in chars)]
            if not holding:
                break
            i = holding[pick(len(holding))]
            where = [p for p, c in enumerate(lines[i]) if c in chars]
            p = where[pick(len(where))]
            options = [r for r in _REPLACEMENTS[kind] if r != lines[i][p]]
            lines[i] = lines[i][:p] + options[pick(len(options))] + lines[i][p + 1:]
    return "".join(lines)


def read_module(text: str, mesh: MeshInfo) -> None:
    """Parses and reads the module as the analysis does."""
    module = parse_hlo(text)
    collectives_of(module, mesh)
    executions(module)
    build_graph(module, mesh)
    for instr in module.instructions():
        for view in _VIEWS:
            getattr(instr, view)
        if instr.opcode == "while":
            trip_count(module, instr)


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    return real_modules(tmp_path_factory.mktemp("hlo-dumps"))


def test_the_real_modules_read_cleanly(modules):
    for name, text, mesh in modules:
        read_module(text, mesh)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_mutated_module_reads_or_raises_hlo_parse_error(modules, kind, data):
    name, text, mesh = data.draw(st.sampled_from(modules), label="module")
    mutated = mutate(text, kind, lambda n: data.draw(st.integers(0, max(n - 1, 0))))
    try:
        read_module(mutated, mesh)
    except HloParseError as e:
        assert re.match(r"HLO line \d+: ", str(e)), str(e)
        assert "\n" not in str(e)


def _count(n: int) -> None:
    import collections
    import random
    import tempfile
    from pathlib import Path

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as dump_root:
        modules = real_modules(Path(dump_root))
    raised: collections.Counter = collections.Counter()
    for k in range(n):
        name, text, mesh = modules[rng.randrange(len(modules))]
        mutated = mutate(text, KINDS[k % len(KINDS)], rng.randrange)
        try:
            read_module(mutated, mesh)
        except HloParseError:
            raised["HloParseError"] += 1
        except Exception as e:  # noqa: BLE001 - counting what escapes
            raised[f"{type(e).__name__}: {re.sub(r'[0-9]+', 'N', str(e))[:70]}"] += 1
    others = sum(v for k, v in raised.items() if k != "HloParseError")
    print(f"{n} mutations: {others} raised something other than HloParseError, "
          f"{raised['HloParseError']} HloParseError, {n - others - raised['HloParseError']} none")
    for kind, count in raised.most_common():
        print(f"  {count:4d}  {kind}")


if __name__ == "__main__":
    import sys

    import conftest  # noqa: F401 - the simulated device count

    _count(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
