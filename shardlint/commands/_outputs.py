"""The files a command writes: refused before any work when the OS will not take them, and
removed again when the run is interrupted.

A report takes seconds to minutes of compiles; a path that cannot be written must fail
first, in one line. Permission bits do not say it (root passes every `os.access` check,
and `/proc` takes no new files whoever asks), so each path is tried: an existing file is
opened for appending (nothing changes), a new one is created and removed, a new folder is
made and removed. What the run will create (a file that is not there yet, the folder made
for it) is registered with `shardlint._interrupt`, which removes it on Ctrl-C, so an
interrupted run leaves nothing; the files themselves are written whole or not at all
(`shardlint._files`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile

from .. import _interrupt
from .._errors import UsageError


def output_file(path: str, what: str) -> str:
    """Checks that `path` can be written (one line, UsageError, if not); returns it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"cannot write {what} to {path}: it is a folder")
    if not os.path.exists(folder):
        raise UsageError(f"cannot write {what} to {path}: the folder {folder} does not exist")
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {what} to {path}: {folder} is a file, not a folder")
    existed = os.path.exists(path)
    try:
        if existed:
            open(path, "a").close()
        else:
            open(path, "x").close()
            os.unlink(path)
    except OSError as e:
        raise UsageError(f"cannot write {what} to {path}: {_refusal(e, folder)}") from e
    if not existed:
        _interrupt.register(path, "file")
    return path


def output_folder(path: str, what: str, files: tuple[str, ...] = ()) -> str:
    """Checks that the folder `path` can be made (if missing) and take `files`; makes
    nothing: the command makes it when it writes."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"cannot write {what} to {path}: it is a file, not a folder")
    missing = _missing_folders(path)
    above = os.path.dirname(missing[0]) if missing else path   # the nearest that exists
    if not os.path.isdir(above):
        raise UsageError(f"cannot write {what} to {path}: {above} is a file, not a folder")
    try:
        for folder in missing:
            os.mkdir(folder)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".shardlint-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"cannot write {what} to {path}: "
                         f"{_refusal(e, os.path.dirname(os.path.abspath(path)))}") from e
    finally:
        for folder in reversed(missing):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
    for folder in missing:
        _interrupt.register(folder, "folder")
    for file in (os.path.join(path, f) for f in files):
        if not os.path.exists(file):
            _interrupt.register(file, "file")
    return path


def _missing_folders(path: str) -> list[str]:
    """The folders `os.makedirs(path)` would make, outermost first."""
    missing = []
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return missing[::-1]


def _refusal(error: OSError, folder: str) -> str:
    """Why the OS refused, in words: `open`'s ENOENT in a folder that exists means the
    folder takes no new files (`/proc`)."""
    if error.errno == errno.ENOENT and os.path.isdir(folder):
        return f"{folder} takes no new files"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if error.errno == errno.EROFS:
        return "read-only file system"
    if error.errno == errno.ENOTDIR:
        return f"{error.filename or folder} is not a folder"
    return error.strerror or str(error)
