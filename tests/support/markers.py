"""Line numbers of `# <- marker` comments, so tests never hard-code where code sits."""

from __future__ import annotations


def marker_line(path: str, marker: str) -> int:
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if line.rstrip().endswith(f"# <- {marker}"):
                return number
    raise LookupError(f"{marker} in {path}")
