"""The terminal summary: findings first, then the collective table, then memory."""

from __future__ import annotations

import json

from .._files import write_text
from .._format import clip, human_bytes
from .._vocab import FindingKind, said, words
from ..analyzer import Analysis, helper_frames, peak_lines, scope_tree, unsourced
from .._source import frames_text


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
            lines.append(f"  [{i}] {at(f)}  {headline(f, analysis)}"
                         + ("  -> feeds a grouped matmul" if f.feeds_grouped_matmul else ""))
            lines.append(f"      op path: {f.op_path}")
            lines.append(f"      {' and '.join(f.operand_shapes) or f.operand_shape}  ->  {f.result_shape}")
            if f.collectives:
                lines.append(f"      costs: {', '.join(f.collectives)} ({human_bytes(f.bytes)} per device"
                             f" per step{_loop_note(analysis, f.collectives)})")
            elif f.kind == FindingKind.DROPPED:
                lines.append("      costs: no collective linked (XLA may recompute or replicate instead)")
            if f.kind == FindingKind.CONTRACTED:
                lines.append(f"      replicated over {', '.join(f.axes)}: {human_bytes(f.replicated_bytes)} of "
                             f"buffers per device; {f.repeated_flops:.3g} FLOPs per device repeated on every shard")
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
    lines += peak_text(m, helpers)
    if fit is not None:
        lines.append(fit.line())
    return "\n".join(lines)


def peak_text(memory, helpers=(), most: int = 6) -> list[str]:
    """The temp at XLA's memory peak by the lines that made it, largest first."""
    lines = peak_lines(memory.peak_buffers, helpers=helpers)
    if not lines or not memory.temp_bytes:
        return []
    share = memory.temp_accounted() / memory.temp_bytes
    out = [f"  temp at the peak, by the line that made it ({share:.0%} of temp accounted for):"]
    for line in lines[:most]:
        where = " via ".join(str(f) for f in (line.source, line.via) if f)
        if not where:   # padding, the runtime's own, an argument: what it is instead
            out.append(f"    {human_bytes(line.bytes):>11}  {line.op}: {line.name or 'no source line'}")
            continue
        behind = f"  <- {line.collective} ({line.cause})" if line.collective else ""
        count = f" x{line.buffers}" if line.buffers > 1 else ""
        free = f", {human_bytes(line.free)} of it free at the peak" if line.free else ""
        out.append(f"    {human_bytes(line.bytes):>11}  {line.op}{count} {line.shape} at {where}"
                   f"{' (backward)' if line.backward else ''}{behind}{free}")
    rest = lines[most:]
    if rest:
        out.append(f"    {human_bytes(sum(line.bytes for line in rest)):>11}  in {len(rest)} more line(s)")
    return out


def mesh_text(mesh: dict[str, int]) -> str:
    """`data=2 x context=4`: size-1 axes left out (MaxText's mesh has twelve axes)."""
    shown = {k: v for k, v in mesh.items() if v > 1} or mesh
    return " x ".join(f"{k}={v}" for k, v in shown.items())


def _compiler(analysis: Analysis) -> str:
    compiler = analysis.platform
    if analysis.topology:
        compiler += f" {analysis.topology}, libtpu {analysis.versions.get('libtpu', '?')}"
    return compiler


def headline(f, analysis: Analysis) -> str:
    """What the finding's op lost, in the words of its collectives (an all-gather gathers,
    an all-to-all moves), and `(backward)` for an op of the backward pass."""
    pairs = words(c for c in analysis.collectives if c.id in f.collectives)
    if f.kind == FindingKind.REMATERIALIZED:
        text = f"{f.op}: involuntary full rematerialization"
    elif f.kind in (FindingKind.UNSPLIT, FindingKind.RESHARDED) and pairs:
        text = f"{f.op} {_LEAD[f.kind]} {said(pairs)}"
    else:
        text = f"{f.op} {verb_phrase(f, analysis)} {', '.join(f.axes)}".rstrip()
    return text + (" (backward)" if f.backward else "")


_LEAD = {FindingKind.UNSPLIT: "cannot be split: its inputs are", FindingKind.RESHARDED: "reshards an operand:"}


def verb_phrase(f, analysis: Analysis) -> str:
    """The words between a finding's op and its axes, as its collectives did it:
    `drops`, `cannot be split: its inputs are gathered over`, `reshards an operand: moved
    over`."""
    if f.kind == FindingKind.REMATERIALIZED:
        return "needs an involuntary full rematerialization"
    if f.kind == FindingKind.DROPPED:
        return "drops"
    if f.kind == FindingKind.CONTRACTED:
        return "sums the tokens away: the expert matmuls after it are replicated over"
    verbs = [verb for verb, _ in words(c for c in analysis.collectives if c.id in f.collectives)]
    default = "gathered" if f.kind == FindingKind.UNSPLIT else "moved"
    return f"{_LEAD[f.kind]} {' and '.join(verbs or [default])} over"


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
    """The analysis (`shardlint.analysis/3`) as a file, written whole or not at all."""
    write_text(path, json.dumps(analysis.to_json(), indent=2) + "\n")


def format_sweep(sweep: dict, title: str = "") -> str:
    """`analyze --sweep`: temp per point against its ideal, before (and after) the rewrite,
    then the lines that hold what does not shrink."""
    from ._data import sweep_scalings
    from ._sweep import check_sweep

    sweep = check_sweep(sweep)
    before, after = sweep_scalings(sweep)
    first = sweep["points"][0]["before"]
    lines = [f"shardlint: {title + ' ' if title else ''}swept over {sweep['axis']}="
             f"{','.join(str(v) for v in before.values)} ({_compiler(first)}, {first.partitioner})", ""]
    rewritten = any(p["after"] is not None or p["refused"] for p in sweep["points"])
    rows = [(sweep["axis"], "mesh", "temp", "ideal", "findings", "all-gathers")
            + (("temp rewritten", "findings") if rewritten else ())]
    for i, point in enumerate(sweep["points"]):
        b, a = point["before"], point["after"]
        row = (str(point["value"]), mesh_text(b.mesh), human_bytes(b.memory.temp_bytes),
               human_bytes(before.ideal[i]), str(len(b.findings)), str(len(b.all_gathers())))
        if rewritten:
            row += (("refused", "-") if point["refused"] else ("-", "-") if a is None
                    else (human_bytes(a.memory.temp_bytes), str(len(a.findings))))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"  the rewrite was refused at {sweep['axis']}={p['value']}: {p['refused']}"
              for p in sweep["points"] if p["refused"]]
    for label, scaling in (("", before), ("rewritten: ", after)):
        if scaling is None:
            continue
        lines += ["", label + scaling.headline()]
        if scaling.above_ideal_explained is not None:
            held = sum(line.excess for line in scaling.lines[:scaling.listed])
            offset = (f"; lines under their ideal offset {human_bytes(scaling.offset)}"
                      if scaling.above_ideal_explained > 1 else "")
            lines.append(f"  the {scaling.listed} line(s) first below hold {human_bytes(held)} above their "
                         f"ideal, {scaling.above_ideal_explained:.0%} of the temp above the ideal{offset}")
        shown = scaling.lines[:max(scaling.listed, 3)] if label == "" else scaling.lines[:scaling.listed]
        if shown:
            head = f"bytes at {sweep['axis']}=" + "/".join(str(v) for v in scaling.values)
            table = [("excess", "scaling", head, "op", "line")]
            table += [(("+" if line.excess > 0 else "") + human_bytes(line.excess), line.scaling,
                       " / ".join(human_bytes(b) for b in line.bytes), line.op,
                       " via ".join(str(f) for f in (line.source, line.via) if f) or clip(unsourced(line), 72))
                      for line in shown]
            widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines)
