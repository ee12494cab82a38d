"""The pytest plugin (registered through the `pytest11` entry point): the
`shardlint_baseline` fixture and the `--shardlint-update` option.

It imports nothing heavy at load time, because pytest loads it in every session of an
environment where shardlint is installed, including ones that never touch JAX; and a
test suite must be able to set JAX's device count in its conftest before JAX starts.
Baselines live next to the tests (`<test folder>/shardlint_baselines/<name>.json` by
default, ini option `shardlint_baseline_dir`) and keys are relative to pytest's rootdir.
"""

from __future__ import annotations

import os
import shlex

import pytest

_WRITTEN = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardlint")
    group.addoption("--shardlint-update", action="store_true", default=False,
                    help="record the current collectives as the baselines of shardlint "
                         "assertions instead of checking them")
    parser.addini("shardlint_baseline_dir", default="shardlint_baselines",
                  help="folder for shardlint baselines, relative to each test file's folder")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_WRITTEN] = []


@pytest.fixture
def shardlint_baseline(request: pytest.FixtureRequest):
    """`shardlint_baseline("train_step")` -> the baseline reference for that name."""
    from shardlint.gate import BaselineRef

    config = request.config
    folder = os.path.join(os.path.dirname(str(request.path)), config.getini("shardlint_baseline_dir"))

    def ref(name: str) -> BaselineRef:
        if not name or os.path.basename(name) != name or name.startswith("."):
            raise ValueError(f"shardlint_baseline({name!r}): give a plain file name such as "
                             f"'train_step' (no folders)")
        return BaselineRef(
            path=os.path.join(folder, f"{name}.json"),
            update=config.getoption("shardlint_update"),
            root=str(config.rootpath),
            update_hint=f"pytest {shlex.quote(request.node.nodeid)} --shardlint-update",
            target=name,
            on_write=config.stash[_WRITTEN].append)

    return ref


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    written = config.stash.get(_WRITTEN, [])
    if written:
        terminalreporter.write_sep("-", "shardlint baselines written")
        for path in written:
            terminalreporter.write_line(os.path.relpath(path, str(config.rootpath)))
