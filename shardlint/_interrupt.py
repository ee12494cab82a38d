"""Ctrl-C: what a run leaves behind, and how the `shardlint` process ends on it.

A KeyboardInterrupt cannot be relied on to unwind the run: SIGINT lands wherever Python
happens to be, and where that is a gc callback (JAX registers one) Python prints
"Exception ignored" and the run goes on as if nothing was pressed; where it is a `finally`
block, the cleanup there stops halfway (one interrupt late in a compile left the compile's
temporary dump folder behind). And after a KeyboardInterrupt raised mid-compile,
XLA's compile threads are still running when the interpreter finalizes, which crashes
(SIGSEGV, exit 139). So the command-line process handles SIGINT itself (`exit_on_sigint`):
it says so on the stderr it started with (a compile may have pointed file descriptor 2
elsewhere), removes what the run registered here, flushes stdout and ends at once with exit
code 130, whatever is running.

What a run registers (`removed_on_interrupt`): the temporary folder a compile dumps into,
the temporary file a write goes through, the outputs a command creates (files, and folders
it makes for them, removed only when empty), and the processes a plan's points run in
(`ended_on_interrupt`: killed, so that no compile goes on after the command). A leaf module:
it imports nothing of shardlint's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys

INTERRUPTED = 130   # 128 + SIGINT, as a shell reports a command Ctrl-C stopped

# path -> how to remove it: "file" (unlink), "folder" (rmdir, only if empty), "tree" (rmtree)
_REGISTERED: dict[str, str] = {}
# processes to kill on Ctrl-C (their ids)
_PROCESSES: set[int] = set()


@contextlib.contextmanager
def ended_on_interrupt(pid: int):
    """The process `pid` is killed if the run is interrupted while the block runs."""
    _PROCESSES.add(pid)
    try:
        yield pid
    finally:
        _PROCESSES.discard(pid)


@contextlib.contextmanager
def removed_on_interrupt(path: str, kind: str = "file"):
    """Registers `path` for the duration of the block (see `register`)."""
    register(path, kind)
    try:
        yield path
    finally:
        forget(path)


def register(path: str, kind: str = "file") -> None:
    """`path` is removed if the run is interrupted: `kind` "file", "folder" (only if empty)
    or "tree" (a temporary folder and all in it)."""
    if kind not in ("file", "folder", "tree"):
        raise ValueError(f"kind must be file, folder or tree, got {kind!r}")
    _REGISTERED[path] = kind


def forget(path: str) -> None:
    """`path` is no longer the run's to remove (removed already, or kept)."""
    _REGISTERED.pop(path, None)


def forget_all() -> None:
    """The run is over: nothing it registered is removed any more."""
    _REGISTERED.clear()


def remove_registered() -> None:
    """Kills the registered processes, then removes what is registered, the latest first
    (files before the folders made for them)."""
    for pid in list(_PROCESSES):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    _PROCESSES.clear()
    for path, kind in reversed(list(_REGISTERED.items())):
        with contextlib.suppress(OSError):
            if kind == "tree":
                shutil.rmtree(path, ignore_errors=True)
                shutil.rmtree(path, ignore_errors=True)   # XLA may have written one more file
            elif kind == "folder":
                os.rmdir(path)
            elif os.path.lexists(path):
                os.unlink(path)
    _REGISTERED.clear()


def exit_on_sigint() -> None:
    """Makes Ctrl-C end this process at once (see the module docstring). For the command
    line's process only: a library must not take over its caller's SIGINT."""
    stderr = os.dup(2)

    def on_sigint(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C changes nothing
        with contextlib.suppress(OSError):
            os.write(stderr, b"shardlint: interrupted\n")
        remove_registered()
        with contextlib.suppress(Exception):   # stdout may be mid-write
            sys.stdout.flush()
        os._exit(INTERRUPTED)

    signal.signal(signal.SIGINT, on_sigint)
