"""How shardlint writes its outputs (reports, JSON documents, baselines): whole or not at
all. A leaf module, used by the reports and the gate alike (it imports only the leaf
`_interrupt`).

A file is written into a temporary file beside it and renamed over it, so Ctrl-C, a full
disk or a crash never leaves half a report where a whole one is expected; the temporary
file goes away with the failure (and on Ctrl-C, `shardlint._interrupt`). A path that is
not a regular file (`/dev/stdout`, a pipe) is written as it is: there is nothing to rename
over.
"""

from __future__ import annotations

import os
import tempfile

from ._interrupt import removed_on_interrupt


def write_text(path: str, text: str) -> None:
    """Writes `text` (UTF-8) to `path` atomically; raises OSError as `open` would."""
    if os.path.exists(path) and not os.path.isfile(path):
        _write_in_place(path, text)
        return
    folder = os.path.dirname(os.path.abspath(path))
    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else _default_mode()
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    except PermissionError:   # a writable file in a folder that takes no new files
        _write_in_place(path, text)
        return
    try:
        with removed_on_interrupt(tmp), os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _write_in_place(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _default_mode() -> int:
    """What `open(path, "w")` would give a new file: 0o666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
