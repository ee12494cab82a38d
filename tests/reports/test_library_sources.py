"""Source lines of an installed library (a package in a site-packages folder, not the
working directory) are shown in the report like the user's own: the finding is in the
library's layer, named `nano_moe/layers.py:N` as `display_path` shows it, and the page
holds the lines around it, read from where the analysis imported it."""

from __future__ import annotations

import pytest

from shardlint.cli import main

LAYERS = '''
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def make_step(mesh):
    x = jax.ShapeDtypeStruct((8, 512, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", "context", None)))
    w = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P()))

    def step(w_DF, x_BSD):
        def loss(w_DF):
            b, s, d = x_BSD.shape
            tokens_TD = x_BSD.reshape(b * s, d)  # the library's flatten
            return jnp.mean(jax.nn.relu(tokens_TD @ w_DF) ** 2)
        return jax.value_and_grad(loss)(w_DF)

    return step, (w, x)
'''


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """nano_moe in a site-packages folder on sys.path; the command runs in another folder."""
    package = tmp_path / "venv" / "lib" / "python3" / "site-packages" / "nano_moe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text(LAYERS)
    monkeypatch.syspath_prepend(str(package.parent))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_an_installed_librarys_lines_are_shown_in_the_report(installed):
    out = installed / "report.html"
    assert main(["report", "nano_moe.layers:make_step", "--mesh", "data=2,context=4", "--no-rewrite",
                 "--out", str(out)]) == 1
    page = out.read_text()
    assert "nano_moe/layers.py:" in page
    assert "is not on this machine" not in page
    assert "# the library&#39;s flatten" in page or "# the library's flatten" in page
