"""The gate's verdict as SARIF 2.1.0, for GitHub code scanning and other SARIF viewers.

One result per changed key (its locations are the source lines of the current collectives,
largest first, relative to the project root through `%SRCROOT%`), three rules (new, grown,
reduced), and a `partialFingerprints` entry derived from the stable key so code scanning
tracks the same collective across runs instead of opening a new alert per line shift.
"""

from __future__ import annotations

import hashlib
import pathlib

from .._vocab import ChangeState
from ._compare import Change, CheckResult
from ._wording import explanation, headline

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_VERSION = "2.1.0"

_RULES = (
    ("shardlint/new-collective", "NewCollective", "error",
     "A collective of a watched kind that the baseline lacks",
     "The step now emits a collective (an all-gather unless --kinds widens the watch) that "
     "the committed baseline does not list. Usually sharding was lost on the way to it; "
     "the message names the finding and the way out. Accept it with `shardlint check ... "
     "--update` if it is intended."),
    ("shardlint/grown-collective", "GrownCollective", "error",
     "A watched collective that moves more bytes or runs more often than in the baseline",
     "A collective with the same stable key has more copies, or moves more bytes per "
     "device than the baseline plus the tolerance."),
    ("shardlint/reduced-collective", "ReducedCollective", "note",
     "A watched collective that went away or moves fewer bytes",
     "An improvement: record it with `shardlint check ... --update`. It never fails the gate."),
)
_RULE_OF = {ChangeState.NEW: 0, ChangeState.GROWN: 1, ChangeState.GONE: 2, ChangeState.SHRUNK: 2}


def sarif_json(result: CheckResult) -> dict:
    from .. import __version__

    rules = [{"id": rid, "name": name, "shortDescription": {"text": short},
              "fullDescription": {"text": full},
              "defaultConfiguration": {"level": level}}
             for rid, name, level, short, full in _RULES]
    return {
        "$schema": SARIF_SCHEMA,
        "version": SARIF_VERSION,
        "runs": [{
            "tool": {"driver": {"name": "shardlint", "version": __version__, "rules": rules}},
            "originalUriBaseIds": {"%SRCROOT%": {"uri": pathlib.Path(result.root).resolve().as_uri() + "/"}},
            "results": [_result(c, result) for c in result.changes],
            "properties": {"baseline": result.baseline_path, "kinds": list(result.kinds),
                           "tolerance": result.tolerance, "passed": result.passed},
        }],
    }


def _result(change: Change, result: CheckResult) -> dict:
    index = _RULE_OF[change.status]
    rid, _name, level, _short, _full = _RULES[index]
    text = " ".join([headline(change) + ".", f"Key: {change.key}.",
                     *explanation(change, result.root)])
    if change.is_regression and result.update_hint:
        text += f" To accept: {result.update_hint}"
    locations = [_location(f, n) for f, n in change.lines(result.root)]
    if not locations and change.file:
        locations = [_location(change.file, None)]
    out = {"ruleId": rid, "ruleIndex": index, "level": level, "message": {"text": text},
           "partialFingerprints": {
               "shardlintKey/v1": hashlib.sha256(change.key.encode()).hexdigest()[:32]}}
    if locations:
        out["locations"] = locations
    return out


def _location(file: str, line: int | None) -> dict:
    physical: dict = {"artifactLocation": {"uri": file, "uriBaseId": "%SRCROOT%"}}
    if line:
        physical["region"] = {"startLine": line}
    return {"physicalLocation": physical}
