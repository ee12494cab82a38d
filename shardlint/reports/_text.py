"""The terminal summary: findings first, then the collective table, then memory."""

from __future__ import annotations

import json

from .._format import clip, human_bytes
from ..analyzer import Analysis, scope_tree
from ..analyzer._model import DROPPED, REMATERIALIZED, RESHARDED, UNSPLIT
from ._frames import frames_text, helper_frames


def format_text(analysis: Analysis, title: str = "", fit=None) -> str:
    """`fit`: the memory check against HBM (`analyzer._fit.fit_of`), printed last."""
    helpers = helper_frames(analysis)

    def at(record) -> str:
        return frames_text(record.stack, helpers, record.source)

    lines = [f"shardlint: {title + ' ' if title else ''}on mesh {mesh_text(analysis.mesh)} "
             f"({_compiler(analysis)}, {analysis.partitioner}"
             + (f", jax {analysis.versions['jax']})" if "jax" in analysis.versions
                else f", read from the XLA dump {analysis.dump})" if analysis.dump else ")")]
    lines += [f"  not in the dump: {note}" for note in analysis.unread]
    lines.append("")
    if analysis.findings:
        lines.append(f"{len(analysis.findings)} finding(s): sharding lost")
        for i, f in enumerate(analysis.findings, 1):
            lines.append(f"  [{i}] {at(f)}  {_headline(f)}"
                         + ("  -> feeds a grouped matmul" if f.feeds_grouped_matmul else ""))
            lines.append(f"      op path: {f.op_path}")
            lines.append(f"      {' and '.join(f.operand_shapes) or f.operand_shape}  ->  {f.result_shape}")
            if f.collectives:
                lines.append(f"      costs: {', '.join(f.collectives)} ({human_bytes(f.bytes)} per device"
                             f" per step{_loop_note(analysis, f.collectives)})")
            elif f.kind == DROPPED:
                lines.append("      costs: no collective linked (XLA may recompute or replicate instead)")
            lines.append(f"      way out: {f.way_out}")
    else:
        lines.append("no findings: no activation is gathered over an axis that sharded it "
                     "without being asked")
    if analysis.requested:
        lines.append("")
        lines.append(f"{len(analysis.requested)} resharding(s) you asked for (not findings):")
        for r in analysis.requested:
            lines.append(f"  {at(r)}  {r.op} asks for a sharding without {', '.join(r.axes)}")
    lines.append("")
    lines.append(f"{len(analysis.collectives)} collective(s):")
    if analysis.collectives:
        rows = [("kind", "cause", "axes", "moved/dev", "shape", "source", "op path")]
        for c in sorted(analysis.collectives, key=lambda c: (-c.step_bytes, c.id)):
            rows.append((c.kind + (" (async)" if c.is_async else ""), c.cause or "-", ",".join(c.axes),
                         human_bytes(c.step_bytes) + _trips(c), clip(c.shape, 36), at(c),
                         clip(c.op_path, 60)))
        n = len(rows[0]) - 1
        widths = [max(len(r[i]) for r in rows) for i in range(n)]
        for r in rows:
            lines.append("  " + "  ".join(r[i].ljust(widths[i]) for i in range(n)) + "  " + r[n])
    m = analysis.memory
    lines.append("")
    lines.append("memory per device: "
                 f"arguments {human_bytes(m.argument_bytes)}, outputs {human_bytes(m.output_bytes)}, "
                 f"temp {human_bytes(m.temp_bytes)}"
                 + (f", peak {human_bytes(m.peak_bytes)}" if m.peak_bytes else "")
                 + (f"; {m.flops:.3g} FLOPs" if m.flops else ""))
    if fit is not None:
        lines.append(fit.line())
    return "\n".join(lines)


def mesh_text(mesh: dict[str, int]) -> str:
    """`data=2 x context=4`: size-1 axes left out (MaxText's mesh has twelve axes)."""
    shown = {k: v for k, v in mesh.items() if v > 1} or mesh
    return " x ".join(f"{k}={v}" for k, v in shown.items())


def _compiler(analysis: Analysis) -> str:
    compiler = analysis.platform
    if analysis.topology:
        compiler += f" {analysis.topology}, libtpu {analysis.versions.get('libtpu', '?')}"
    return compiler


def _headline(f) -> str:
    if f.kind == REMATERIALIZED:
        return f"{f.op}: involuntary full rematerialization"
    if f.kind == UNSPLIT:
        return f"{f.op} cannot be split: its inputs are gathered over {', '.join(f.axes)}"
    if f.kind == RESHARDED:
        return f"{f.op} reshards an operand over {', '.join(f.axes)}"
    return f"{f.op} drops {', '.join(f.axes)}"


def _trips(c) -> str:
    if not c.in_loop:
        return ""
    return f" (x{c.trips})" if c.trips else " (loop)"


def _loop_note(analysis: Analysis, ids) -> str:
    trips = {c.trips for c in analysis.collectives if c.id in ids and c.in_loop}
    if len(trips) == 1 and None not in trips:
        return f", x{trips.pop()} iterations"
    return ", in a loop of unknown trip count" if None in trips else ""


def format_scopes(analysis: Analysis, max_depth: int = 4) -> str:
    """The collectives rolled up by scope (`analyzer.scope_tree`): one line per scope, its
    forward and backward counts and bytes per device per step, sub-scopes indented."""
    tree = scope_tree(analysis)
    rows = [(node, depth) for node, depth in tree.walk() if depth <= max_depth and node.total.count]
    width = max((2 * depth + len(node.name) for node, depth in rows), default=5)
    lines = ["collectives by scope (per device, per step; a scope includes its sub-scopes):",
             f"  {'scope':<{width}}  {'forward':>18}  {'backward':>18}  kinds"]
    for node, depth in rows:
        kinds = ", ".join(f"{kind} {t.count}" for kind, t in node.kinds)
        lines.append(f"  {'  ' * depth + node.name:<{width}}  {_traffic(node.forward):>18}  "
                     f"{_traffic(node.backward):>18}  {kinds}")
    return "\n".join(lines)


def _traffic(t) -> str:
    return f"{t.count} / {human_bytes(t.bytes)}" if t.count else "-"


def write_json(analysis: Analysis, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(analysis.to_json(), fh, indent=2)
        fh.write("\n")
