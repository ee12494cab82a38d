"""What XLA's C++ code logs while it compiles the step, caught at the file descriptor.

XLA's SPMD partitioner writes `[SPMD] Involuntary full rematerialization. The compiler
cannot go from sharding {A} to {B} efficiently for HLO operation %op = ...` to C++ stderr
when a reshard falls back to replicate-and-slice. Python's `sys.stderr` never sees it, so the analysis compile points
file descriptor 2 at a temporary file, reads the messages back as typed records (they
become findings), and passes every other line on to the real stderr unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile

# JAX 0.10.2 and 0.12.0.1 print "The compiler cannot go from sharding {A} to {B} efficiently
# for HLO operation %op = ..."; older XLA printed "was not able to go from ... without doing
# a full rematerialization of the tensor for HLO operation: %op".
_REMAT_RE = re.compile(
    r"Involuntary full rematerialization\. The compiler (?:cannot|was not able to) go from "
    r"sharding (?P<source>\{.*?\}) to (?P<target>\{.*?\}) (?:efficiently|without doing a "
    r"full rematerialization of the tensor) for HLO operation:? %?(?P<name>[^\s=]+)"
    r"(?P<rest>[^\n]*)")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Remat:
    """One involuntary full rematerialization: XLA replicated a value to reshard it."""

    instruction: str        # the HLO instruction being partitioned
    source_sharding: str    # XLA's sharding text before
    target_sharding: str    # and the one it needed
    op_name: str = ""       # its JAX op path, from the instruction's metadata


@dataclasses.dataclass
class _Log:
    text: str = ""


@contextlib.contextmanager
def captured_stderr():
    """Captures what C++ code writes to fd 2; yields a holder whose `.text` is set on exit.

    Lines that are not rematerialization messages go on to the real stderr."""
    log = _Log()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            log.text = sink.read().decode("utf-8", errors="replace")
            rest = "".join(line for line in log.text.splitlines(keepends=True)
                           if "Involuntary full rematerialization" not in line)
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()


def involuntary_rematerializations(text: str) -> tuple[Remat, ...]:
    found = []
    for m in _REMAT_RE.finditer(text):
        op_name = _OP_NAME_RE.search(m.group("rest"))
        found.append(Remat(instruction=m.group("name").rstrip(".,"), source_sharding=m.group("source"),
                           target_sharding=m.group("target"), op_name=op_name.group(1) if op_name else ""))
    return tuple(dict.fromkeys(found))
