"""Baseline versus a fresh analysis: what is new, what grew, what went away.

Only watched kinds (all-gather unless widened) can fail the gate, so an unrelated
all-reduce moving around never blocks a pull request. Per key: a key the baseline lacks
is new; more copies than the baseline counted is growth whatever the tolerance (a second
copy is a second collective); more bytes than the baseline's total plus the tolerance is
growth. A key that went away or moves less is an improvement, reported but never failing.
Each change carries the current collectives behind it and the findings that name them, so
every output format can say where the collective comes from and why XLA emitted it.
"""

from __future__ import annotations

import dataclasses
import math

from .._errors import UsageError
from .._vocab import COLLECTIVE_KINDS, ChangeState, CollectiveKind
from ..analyzer import Analysis, Collective, Finding
from ._baseline import Baseline, Entry, entry_of, group_by_key
from .._format import relative_source
from ._keys import CollectiveKey

DEFAULT_KINDS = (CollectiveKind.ALL_GATHER,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Change:
    status: ChangeState          # new | grown (fail), gone | shrunk (improvement)
    key: str
    kind: str
    file: str                    # relative to the project root, "" when unknown
    count: int
    bytes: int                   # per device, summed over the key's collectives
    baseline_count: int
    baseline_bytes: int
    collectives: tuple[Collective, ...] = ()   # current ones with this key, largest first
    findings: tuple[Finding, ...] = ()         # findings that name any of them

    @property
    def is_regression(self) -> bool:
        return self.status in (ChangeState.NEW, ChangeState.GROWN)

    @property
    def parts(self) -> CollectiveKey | None:
        """The key's fields (None for a baseline key of another form)."""
        return CollectiveKey.parse(self.key)

    @property
    def axes(self) -> tuple[str, ...]:
        if self.collectives:
            return self.collectives[0].axes
        return self.parts.axes if self.parts else ()

    @property
    def function(self) -> str:
        """The enclosing function, from the current collectives or else from the key."""
        for c in self.collectives:
            if c.source and c.source.function:
                return c.source.function
        return self.parts.function if self.parts else ""

    def lines(self, root: str) -> tuple[tuple[str, int], ...]:
        """Distinct (relative file, line) of the current collectives, largest first."""
        seen: list[tuple[str, int]] = []
        for c in self.collectives:
            if c.source and c.source.line > 0:
                where = (relative_source(c.source.file, root), c.source.line)
                if where not in seen:
                    seen.append(where)
        return tuple(seen)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckResult:
    baseline_path: str
    root: str
    kinds: tuple[str, ...]
    tolerance: float             # fraction of the baseline's bytes, 0.05 = 5%
    changes: tuple[Change, ...]  # regressions first, then improvements
    mesh: dict[str, int]
    baseline_mesh: dict[str, int]
    jax: str
    baseline_jax: str
    update_hint: str = ""        # the command that accepts the current collectives

    @property
    def passed(self) -> bool:
        return not self.regressions

    @property
    def regressions(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.is_regression)

    @property
    def improvements(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if not c.is_regression)

    def notes(self) -> tuple[str, ...]:
        """Why keys may differ for reasons other than the code (mesh, JAX version)."""
        notes = []
        if self.baseline_mesh and self.baseline_mesh != self.mesh:
            notes.append(f"the baseline was recorded on mesh {mesh_text(self.baseline_mesh)}, "
                         f"this run is on {mesh_text(self.mesh)}: per-device shapes, and so "
                         f"keys, differ")
        if self.baseline_jax and self.jax and self.baseline_jax != self.jax:
            notes.append(f"the baseline was recorded with jax {self.baseline_jax}, this run "
                         f"uses jax {self.jax}: XLA may emit different collectives")
        return tuple(notes)


def mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items()) or "-"


def parse_kinds(text: str) -> tuple[str, ...]:
    """`all-gather,all-to-all` -> ("all-gather", "all-to-all"); `all` watches every kind."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if words == ["all"]:
        return COLLECTIVE_KINDS
    unknown = [w for w in words if w not in COLLECTIVE_KINDS]
    if unknown or not words:
        raise UsageError(f"--kinds: unknown collective kind {', '.join(unknown) or repr(text)}; "
                         f"choose from {', '.join(COLLECTIVE_KINDS)} (comma-separated) or 'all'")
    return tuple(CollectiveKind(w) for w in dict.fromkeys(words))


def parse_tolerance(text: str) -> float:
    """`5%` or `5` -> 0.05: allowed growth in bytes per key, in percent of the baseline."""
    number = text.strip().removesuffix("%").strip()
    try:
        percent = float(number)
    except ValueError:
        percent = -1.0
    if not math.isfinite(percent) or percent < 0:
        raise UsageError(f"--tolerance: cannot read {text!r}; give a percentage >= 0, e.g. "
                         f"--tolerance 5%")
    return percent / 100


def compare(analysis: Analysis, baseline: Baseline, *, root: str, baseline_path: str = "",
            kinds: tuple[str, ...] = DEFAULT_KINDS, tolerance: float = 0.0,
            update_hint: str = "") -> CheckResult:
    """Compares the watched kinds of `analysis` with `baseline`, key by key."""
    watched = set(kinds)
    groups = group_by_key((c for c in analysis.collectives if c.kind in watched), root)
    before = {k: e for k, e in baseline.by_key().items() if e.kind in watched}
    findings_of = _findings_by_collective(analysis.findings)
    changes = []
    for key in sorted(set(groups) | set(before)):
        members = groups.get(key, [])
        now = entry_of(key, members, root) if members else None
        change = _change(key, now, before.get(key), tolerance)
        if change is None:
            continue
        linked = []
        for c in members:
            linked.extend(f for f in findings_of.get(c.id, ()) if f not in linked)
        changes.append(dataclasses.replace(change, collectives=tuple(members),
                                           findings=tuple(linked)))
    changes.sort(key=lambda c: (not c.is_regression, -abs(c.bytes - c.baseline_bytes), c.key))
    return CheckResult(baseline_path=baseline_path, root=root, kinds=tuple(kinds),
                       tolerance=tolerance, changes=tuple(changes), mesh=dict(analysis.mesh),
                       baseline_mesh=dict(baseline.mesh), jax=analysis.versions.get("jax", ""),
                       baseline_jax=baseline.jax, update_hint=update_hint)


def _change(key: str, now: Entry | None, then: Entry | None, tolerance: float) -> Change | None:
    if now is None and then is None:
        return None
    if then is None:
        return Change(status=ChangeState.NEW, key=key, kind=now.kind, file=now.file, count=now.count,
                      bytes=now.bytes, baseline_count=0, baseline_bytes=0)
    if now is None:
        return Change(status=ChangeState.GONE, key=key, kind=then.kind, file=then.file, count=0, bytes=0,
                      baseline_count=then.count, baseline_bytes=then.bytes)
    allowed = then.bytes + math.floor(then.bytes * tolerance)
    if now.count > then.count or now.bytes > allowed:
        status = ChangeState.GROWN
    elif now.count < then.count or now.bytes < then.bytes:
        status = ChangeState.SHRUNK
    else:
        return None
    return Change(status=status, key=key, kind=now.kind, file=now.file, count=now.count, bytes=now.bytes,
                  baseline_count=then.count, baseline_bytes=then.bytes)


def _findings_by_collective(findings: tuple[Finding, ...]) -> dict[str, list[Finding]]:
    linked: dict[str, list[Finding]] = {}
    for f in findings:
        for cid in f.collectives:
            linked.setdefault(cid, []).append(f)
    return linked
