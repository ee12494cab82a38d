"""Reads the folder that `XLA_FLAGS=--xla_dump_to=DIR` writes: the one reading path.

The live analysis compiles with its dump pointed at a temporary folder and reads it back
with `read_dump`; `shardlint analyze --xla-dump DIR` reads the folder a real job wrote with
the same function. Per compiled module XLA writes, under one file-name stem
(`module_0012.jit_train_step`, on TPU followed by `.cl_<changelist>`):

- `STEM.before_optimizations.txt`: the HLO it was given (its mesh);
- `STEM.[cpu_|sm_9.0_gpu_]after_optimizations.txt`: the partitioned, optimized HLO, with
  every collective;
- `STEM.NNNN.<pipeline>.after_<pass>.before_<next>.txt`: the module after each pass that
  `--xla_dump_hlo_pass_re` names; the analysis reads the last sharding-propagation pass
  (`shardy-xla` for Shardy, `sharding-propagation` for GSPMD);
- `STEM.*after_optimizations-buffer-assignment.txt`: the buffer assignment (memory), and
  with `--xla_dump_buffer_assignment_analysis` `STEM.*after_optimizations-live-range.txt`
  (the buffers alive at the memory peak);
- `STEM/module.mlir`: the StableHLO the compiler was given (what the code asked for).

The training step is the largest module (by lines of partitioned HLO). A folder where that
is not clear needs `--module`: the largest module's name was compiled more than once (a
step recompiled for new shapes or shardings), or the next one is within 10% of its size. Nothing here interprets HLO: the texts go to the one parser.
"""

from __future__ import annotations

import dataclasses
import os
import re

from ..._errors import AnalysisError

# What a real job adds to XLA_FLAGS so that shardlint reads everything it reads live.
PROPAGATION_PASSES = "shardy-xla|sharding-propagation"
DUMP_FLAGS = (f"--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_pass_re='{PROPAGATION_PASSES}' "
              "--xla_dump_buffer_assignment_analysis")

_STEM_RE = re.compile(r"^(module_(\d+)\..+)\.before_optimizations\.txt$")
_PARTITIONED_RE = re.compile(r"^\.(?:(?P<prefix>[\w.\-]+)_)?after_optimizations\.txt$")
_PROPAGATED_RE = re.compile(r"^\.(\d+)\.[\w\-]+\.after_(shardy-xla|sharding-propagation)\.before_.*\.txt$")
_BUFFERS_RE = re.compile(r"^\.(?:[\w.\-]+_)?after_optimizations-buffer-assignment\.txt$")
_LIVE_RANGE_RE = re.compile(r"^\.(?:[\w.\-]+_)?after_optimizations-live-range\.txt$")
# The largest module must be this much larger than the next to be "the" step.
_CLEAR_MARGIN = 1.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class DumpedModule:
    """The texts XLA wrote for one compiled module; None where the folder lacks a file."""

    folder: str
    stem: str                        # module_0012.jit_train_step (the files' common prefix)
    name: str                        # the HLO module's name, jit_train_step
    platform: str                    # cpu, gpu or tpu, from the file names
    partitioned: str                 # HLO after optimizations: every collective
    propagated: str | None = None    # HLO after the last sharding-propagation pass
    propagation_pass: str | None = None  # its pass: shardy-xla (Shardy) or sharding-propagation
    given: str | None = None         # HLO before optimizations: its mesh
    stablehlo: str | None = None     # the StableHLO the compiler was given (module.mlir)
    buffer_assignment: str | None = None
    live_range: str | None = None    # the live ranges at the peak (buffer-assignment analysis)
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # text -> its file's path

    @property
    def partitioner(self) -> str:
        """The partitioner XLA ran, read from the module: "shardy" when it names Shardy
        meshes or was propagated by shardy-xla, else "gspmd" (JAX's switch is not the
        answer: JAX 0.12.1 lowers to Shardy with jax_use_shardy_partitioner=False)."""
        header = (self.given or self.partitioned).split("\n", 1)[0]
        return ("shardy" if "xla.sdy.meshes" in header or self.propagation_pass == "shardy-xla"
                else "gspmd")

    def unread(self) -> tuple[str, ...]:
        """What the folder lacks and what the analysis then cannot say, one line each."""
        notes = []
        if self.propagated is None:
            notes.append(f"no module after sharding propagation (dump with "
                         f"--xla_dump_hlo_pass_re='{PROPAGATION_PASSES}'): collectives and their "
                         f"causes only, no propagation drops")
        if self.stablehlo is None:
            notes.append(f"no {self.stem}/module.mlir: what the code asked for (constraints, "
                         f"shard_map specs) is unknown, so a gather it asked for can read as lost")
        if self.given is None:
            notes.append(f"no {self.stem}.before_optimizations.txt: the mesh comes from "
                         f"module.mlir or --mesh")
        if self.buffer_assignment is None:
            notes.append("no buffer-assignment dump: memory unknown")
        elif self.live_range is None:
            notes.append("no live-range dump (add --xla_dump_buffer_assignment_analysis): the "
                         "buffers at the memory peak are not listed")
        elif self.platform == "tpu":
            notes.append("TPU runtime buffers outside the buffer assignment (XLA's 1 MiB HBM "
                         "logging buffer, ...): temp reads lower than memory_analysis() live")
        return tuple(notes)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    stem: str
    number: int
    partitioned_file: str
    prefix: str
    lines: int

    def label(self) -> str:
        return f"{self.stem} ({self.lines:,} lines)"


def read_dump(folder: str, module: str | None = None, *, compiled_only: bool = False) -> DumpedModule:
    """The training step's module in `folder` (or the one `module` names: its HLO name,
    its stem, or its number such as `module_0012`). `compiled_only` leaves out the given
    HLO and the StableHLO: a live compile knows them from the traced program."""
    chosen = _choose(_candidates(folder), folder, module)
    files = set(os.listdir(folder))

    def text(name: str | None) -> str | None:
        return _read(os.path.join(folder, name)) if name else None

    rest = sorted(f[len(chosen.stem):] for f in files if f.startswith(chosen.stem + "."))
    propagated = [r for r in rest if _PROPAGATED_RE.match(r)]
    buffers = [r for r in rest if _BUFFERS_RE.match(r)]
    live = [r for r in rest if _LIVE_RANGE_RE.match(r)]
    partitioned = text(chosen.partitioned_file)
    mlir = os.path.join(folder, chosen.stem, "module.mlir")
    names = {"partitioned": chosen.partitioned_file,
             "propagated": chosen.stem + propagated[-1] if propagated else None,
             "given": chosen.stem + ".before_optimizations.txt"}
    return DumpedModule(
        folder=folder,
        stem=chosen.stem,
        name=_module_name(partitioned, chosen.stem),
        platform=_platform(chosen.prefix, chosen.stem, files),
        partitioned=partitioned,
        propagated=text(names["propagated"]),
        propagation_pass=_PROPAGATED_RE.match(propagated[-1]).group(2) if propagated else None,
        given=None if compiled_only else text(names["given"]),
        stablehlo=_read(mlir) if os.path.isfile(mlir) and not compiled_only else None,
        buffer_assignment=text(chosen.stem + buffers[0]) if buffers else None,
        live_range=text(chosen.stem + live[0]) if live else None,
        files={k: os.path.join(folder, v) for k, v in names.items() if v},
    )


def _candidates(folder: str) -> list[_Candidate]:
    if os.path.isfile(folder):
        raise AnalysisError(f"{folder} is a file; give the folder XLA dumped into "
                            f"(XLA_FLAGS=\"--xla_dump_to=DIR ...\"), e.g. --xla-dump DIR")
    if not os.path.isdir(folder):
        raise AnalysisError(f"the XLA dump folder {folder} does not exist")
    files = os.listdir(folder)
    if not files:
        raise AnalysisError(f"the XLA dump folder {folder} is empty; write one with "
                            f"XLA_FLAGS=\"{DUMP_FLAGS}\"")
    found = []
    for f in files:
        m = _STEM_RE.match(f)
        if not m:
            continue
        stem = m.group(1)
        rest = [g[len(stem):] for g in files if g.startswith(stem + ".")]
        after = [(r, _PARTITIONED_RE.match(r)) for r in rest]
        after = [(r, p) for r, p in after if p]
        if after:
            r, p = after[0]
            found.append(_Candidate(stem, int(m.group(2)), stem + r, p.group("prefix") or "",
                                    _line_count(os.path.join(folder, stem + r))))
    if not found:
        texts = [f for f in files if f.endswith(".txt")]
        protos = [f for f in files if f.endswith((".pb", ".pbtxt"))]
        raise AnalysisError(
            f"the XLA dump folder {folder} holds no HLO module after optimizations "
            + (f"({len(protos)} protos, no text: add --xla_dump_hlo_as_text)" if protos and not texts
               else f"({len(files)} files, e.g. {', '.join(sorted(files)[:3]) or 'none'})")
            + f"; write one with XLA_FLAGS=\"{DUMP_FLAGS}\"")
    return sorted(found, key=lambda c: (-c.lines, c.number))


def _choose(candidates: list[_Candidate], folder: str, module: str | None) -> _Candidate:
    if module is not None:
        wanted = module.strip()
        number = re.fullmatch(r"(?:module_)?(\d+)", wanted)
        picked = [c for c in candidates
                  if c.stem == wanted or _name_of(c) == wanted
                  or (number and c.number == int(number.group(1)))]
        if len(picked) == 1:
            return picked[0]
        if picked:
            raise AnalysisError(f"--module {module} names {len(picked)} modules in {folder}: "
                                f"{', '.join(c.label() for c in picked)}; give the number "
                                f"(e.g. --module {picked[0].stem.split('.')[0]})")
        raise AnalysisError(f"--module {module}: no such module in {folder}; it has "
                            f"{_listing(candidates)}")
    largest = candidates[0]
    name = _name_of(largest)
    again = [c for c in candidates[1:] if _name_of(c) == name]
    if again:
        raise AnalysisError(f"{folder} holds {name} compiled {len(again) + 1} times: "
                            f"{_listing([largest, *again])}; pick one with --module "
                            f"{largest.stem.split('.')[0]} (a number)")
    if len(candidates) > 1 and largest.lines < _CLEAR_MARGIN * candidates[1].lines:
        raise AnalysisError(f"{folder} holds {len(candidates)} modules and the two largest are of "
                            f"similar size: {largest.label()}, {candidates[1].label()}; pick "
                            f"the training step with --module NAME")
    return largest


def _name_of(candidate: _Candidate) -> str:
    return candidate.stem.split(".", 2)[1]


def _listing(candidates: list[_Candidate], most: int = 5) -> str:
    shown = ", ".join(c.label() for c in candidates[:most])
    more = len(candidates) - most
    return shown + (f" and {more} more" if more > 0 else "")


def _module_name(text: str, stem: str) -> str:
    """The name on the `HloModule NAME` line; the file's own name where that line is
    missing (the parser then says what is wrong, and where)."""
    m = re.match(r"HloModule ([^\s,]+)", text)
    return m.group(1) if m else stem.split(".", 2)[1]


def _platform(prefix: str, stem: str, files: set[str]) -> str:
    if "cpu" in prefix:
        return "cpu"
    if "gpu" in prefix:
        return "gpu"
    return "tpu" if stem + ".tpu_comp_env.txt" in files else prefix or "unknown"


def _line_count(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError as e:
        raise AnalysisError(f"cannot read {path}: {e.strerror or e}") from e
