"""What an analysis produces: frozen records that every consumer reads as they are.

The terminal summary, the JSON document (`shardlint.analysis/3`), the HTML report and
the CI gate all read these records; nothing downstream re-parses compiler text.
`Analysis.to_json()` and `Analysis.from_json()` are exact inverses so that a saved
analysis can be reported or gated later.

Every collective carries a `cause` from a closed set (`Cause`, in `shardlint._vocab`), the
op that needed it (`needed_by`) and the user's `stack` (innermost first, library frames
dropped); `source` is the innermost frame of that stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._source import Source
from .._vocab import ArgumentRole, BufferRole, Cause, CollectiveKind, FindingKind

SCHEMA = "shardlint.analysis/3"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective in the partitioned program, as one device sees it."""

    id: str                      # the HLO instruction name, unique within the module
    kind: CollectiveKind         # all-gather, all-reduce, reduce-scatter, all-to-all, ...
    axes: tuple[str, ...]        # mesh axes it communicates over
    bytes: int                   # bytes moved per device (ring estimate, see README)
    result_bytes: int            # bytes of the per-device result
    shape: str                   # per-device result, e.g. "f32[2,64,16]"
    op_path: str                 # JAX op path of the op it is attributed to
    source: Source | None        # source line of that op
    is_async: bool = False
    in_loop: bool = False        # inside a while body (executes once per iteration)
    xla_op_path: str = ""        # the op_name XLA itself attached (differs across versions)
    xla_source: Source | None = None
    cause: Cause | str = ""      # a Cause ("" until explained)
    needed_by: str = ""          # the op that needed it: reshape, scatter, top_k, dot_general, ...
    stack: tuple[Source, ...] = ()  # the user's frames of that op, innermost first
    trips: int | None = 1        # executions per step: a loop's trip count (None: unknown)

    @property
    def step_bytes(self) -> int:
        """Bytes moved per device per step (a loop body's collective runs once per trip)."""
        return self.bytes * (self.trips or 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
    """An op where XLA drops a mesh axis that its operand was sharded over."""

    kind: FindingKind            # how XLA lost the sharding
    op: str                      # reshape, sort, top_k, cumsum, ...
    axes: tuple[str, ...]        # mesh axes lost
    feeds_grouped_matmul: bool
    source: Source | None
    op_path: str
    operand_shape: str           # global shape and sharding, e.g. "f32[4,64,16]{data,context,-}"
    result_shape: str
    collectives: tuple[str, ...]  # ids of the collectives it causes
    bytes: int                   # bytes those collectives move per device
    message: str
    way_out: str
    neighbourhood: Neighbourhood | None = None
    operand_spec: tuple[tuple[str, ...], ...] = ()   # mesh axes per operand dim, as propagated
    operand_dims: tuple[int, ...] = ()                # the operand's global shape
    # a resharded-operand finding's operands, each "global shape P(...)", as propagated
    operand_shapes: tuple[str, ...] = ()
    cause: Cause = Cause.LOST
    needed_by: str = ""          # the op that needed the gathers (the finding's op, or its consumer)
    stack: tuple[Source, ...] = ()
    backward: bool = False       # the op belongs to the backward pass (a transpose)
    # contracted-tokens: per device, the bytes of the buffers replicated over `axes` (the
    # contraction's result and the expert matmuls' results after it)
    replicated_bytes: int = 0
    # contracted-tokens: per device, the FLOPs those expert matmuls compute beyond a shard's share
    repeated_flops: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphNode:
    id: str
    op: str                      # HLO opcode
    shape: str                   # global shape with XLA's propagated sharding
    source: Source | None
    focus: bool = False          # the op the finding is about


@dataclasses.dataclass(frozen=True, kw_only=True)
class Neighbourhood:
    """The ops around a finding in the propagated graph, for drawing."""

    nodes: tuple[GraphNode, ...]
    edges: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Requested:
    """A resharding the user asked for (sharding constraint, shard_map specs)."""

    op: str
    axes: tuple[str, ...]        # mesh axes the asked sharding drops
    source: Source | None
    op_path: str
    stack: tuple[Source, ...] = ()
    asked: tuple[tuple[str, ...], ...] = ()   # the asked sharding: mesh axes per dimension


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeakBuffer:
    """One buffer of the step at XLA's memory peak (per device), from its buffer assignment
    and live ranges. A temp buffer accounts for the bytes it holds at the peak, and for the
    bytes of its slot that are free at the peak (`alive` False: XLA's packing keeps that
    slot for it at another time); each byte of the temp allocation counts once."""

    value: str                   # the HLO value: its instruction's name ({i}: a tuple element)
    role: BufferRole             # temp, argument, output or constant
    bytes: int                   # bytes it accounts for at the peak
    size: int                    # the buffer's own size
    alive: bool                  # alive at the peak
    shape: str                   # per-device, e.g. "f32[512,64]"
    op: str                      # the JAX primitive that made it (an argument: "parameter")
    op_path: str                 # JAX's op path; for an argument, its name (`params['w_in']`)
    source: Source | None
    stack: tuple[Source, ...] = ()
    backward: bool = False       # made by the backward pass (a transpose)
    collective: str = ""         # the collective whose result it holds or is computed from
    cause: Cause | str = ""      # that collective's cause


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int | None       # XLA's peak per device; None where it computes none that
                                 # covers temp (XLA:CPU): there arguments + outputs + temp is it
    flops: float | None          # XLA's cost analysis, per device (XLA:CPU counts ragged_dot as
                                 # a dense dot over every expert)
    peak_buffers: tuple[PeakBuffer, ...] = ()   # largest first; () where XLA wrote no live ranges

    @classmethod
    def empty(cls, flops: float | None = None) -> Memory:
        """No sizes known (no memory statistics), no peak; `flops` where a cost analysis came."""
        return cls(argument_bytes=0, output_bytes=0, temp_bytes=0, alias_bytes=0, peak_bytes=None,
                   flops=flops)

    def temp_accounted(self) -> int:
        """Bytes of temp that the buffers of `peak_buffers` hold (not the padding and the
        runtime's own, which are listed as such)."""
        return sum(b.bytes for b in self.peak_buffers if b.role == BufferRole.TEMP and b.value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoFit:
    """The compiler refused the step for lack of device memory (a TPU compile's
    `RESOURCE_EXHAUSTED`), with its own figures: what it needed (the HLO temporaries, as it
    words it) against what it had, each None where its message gave none."""

    needed_bytes: int | None
    available_bytes: int | None
    message: str                 # the compiler's first line


@dataclasses.dataclass(frozen=True, kw_only=True)
class Analysis:
    mesh: dict[str, int]
    memory: Memory
    collectives: tuple[Collective, ...]
    findings: tuple[Finding, ...]
    requested: tuple[Requested, ...]
    versions: dict[str, str]
    partitioner: str             # "shardy" or "gspmd"
    platform: str = "cpu"
    topology: str | None = None
    dump: str | None = None         # the XLA dump folder it was read from (None: a live compile)
    unread: tuple[str, ...] = ()    # what that folder lacked and what that leaves unsaid
    # per leaf of the step's positional arguments (live): weight (a parameter only moved),
    # input (an activation it is handed: integers, token inputs) or unused (jit drops it)
    argument_roles: tuple[ArgumentRole, ...] = ()
    # The compiler refused the step for lack of memory: the analysis is of the program it
    # partitioned and assigned buffers to before it refused (memory from that buffer
    # assignment; no FLOPs)
    does_not_fit: NoFit | None = None

    def all_gathers(self) -> tuple[Collective, ...]:
        return tuple(c for c in self.collectives if c.kind == CollectiveKind.ALL_GATHER)

    def by_cause(self, cause: Cause) -> tuple[Collective, ...]:
        return tuple(c for c in self.collectives if c.cause == cause)

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc = {"schema": SCHEMA, **doc}
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Analysis:
        if doc.get("schema") != SCHEMA:
            old = str(doc.get("schema", "")).startswith("shardlint.analysis/")
            raise ValueError(
                f"not a {SCHEMA} document (schema={doc.get('schema')!r})"
                + ("; it was written by an older shardlint: analyze the step again to write "
                   "the current schema" if old else ""))

        def src(d):
            return Source(**d) if d else None

        def stack(frames):
            return tuple(Source(**f) for f in frames or ())

        return cls(
            mesh=dict(doc["mesh"]),
            memory=Memory(**{**doc["memory"], "peak_buffers": tuple(
                PeakBuffer(**{**b, "source": src(b["source"]), "stack": stack(b.get("stack"))})
                for b in doc["memory"].get("peak_buffers", ()))}),
            collectives=tuple(
                Collective(**{**c, "axes": tuple(c["axes"]), "source": src(c["source"]),
                              "xla_source": src(c.get("xla_source")), "stack": stack(c.get("stack"))})
                for c in doc["collectives"]),
            findings=tuple(
                Finding(**{**f, "axes": tuple(f["axes"]), "collectives": tuple(f["collectives"]),
                           "source": src(f["source"]),
                           "neighbourhood": _neighbourhood(f.get("neighbourhood")),
                           "operand_spec": tuple(tuple(d) for d in f.get("operand_spec", ())),
                           "operand_dims": tuple(f.get("operand_dims", ())),
                           "operand_shapes": tuple(f.get("operand_shapes", ())),
                           "stack": stack(f.get("stack"))})
                for f in doc["findings"]),
            requested=tuple(
                Requested(**{**r, "axes": tuple(r["axes"]), "source": src(r["source"]),
                             "stack": stack(r.get("stack")),
                             "asked": tuple(tuple(d) for d in r.get("asked", ()))})
                for r in doc["requested"]),
            versions=dict(doc["versions"]),
            partitioner=doc["partitioner"],
            platform=doc.get("platform", "cpu"),
            topology=doc.get("topology"),
            dump=doc.get("dump"),
            unread=tuple(doc.get("unread", ())),
            argument_roles=tuple(doc.get("argument_roles", ())),
            does_not_fit=NoFit(**doc["does_not_fit"]) if doc.get("does_not_fit") else None,
        )


def _neighbourhood(doc) -> Neighbourhood | None:
    if not doc:
        return None
    nodes = tuple(GraphNode(**{**n, "source": Source(**n["source"]) if n["source"] else None})
                  for n in doc["nodes"])
    return Neighbourhood(nodes=nodes, edges=tuple(tuple(e) for e in doc["edges"]))
