"""Source stacks: XLA's stack-frame tables, the user's frames, and how they are printed."""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlint.analyzer import Source
from shardlint.analyzer.explain import _detect
from shardlint.analyzer.parse import _hlo
from shardlint.analyzer.parse._hlo import parse_hlo
from shardlint._source import display_path, user_stack
from shardlint.examples import steps
from shardlint.moe.layers import _routing

from support.markers import marker_line


def _marker(tag: str) -> int:
    return marker_line(__file__, tag)


def _inner(x):
    return jnp.cumsum(x, axis=1)  # <- inner


def _middle(x):
    return _inner(x) * 2  # <- middle


def _outer(x):
    return _middle(x) + 1  # <- outer


@pytest.fixture(scope="module")
def chain(mesh):
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", "context")))
    module = parse_hlo(jax.jit(_outer).lower(x).compile().as_text())
    return next(i for i in module.instructions() if i.opcode == "reduce-window")


def test_a_helper_of_a_helper_has_every_frame_innermost_first(chain):
    assert len(chain.stack) >= 3
    assert [f.line for f in chain.stack[:3]] == [_marker("inner"), _marker("middle"), _marker("outer")]
    assert [f.function for f in chain.stack[:3]] == ["_inner", "_middle", "_outer"]
    assert all(f.file == __file__ for f in chain.stack[:3])
    assert chain.source == chain.stack[0]  # the innermost frame, as before


def test_the_users_frames_print_relative_to_the_working_directory(chain):
    mine = user_stack(chain.stack)
    here = os.path.relpath(__file__)
    assert [f"{display_path(f.file)}:{f.line}" for f in mine[:2]] == [
        f"{here}:{_marker('inner')}", f"{here}:{_marker('middle')}"]
    # The test runner's frames (pytest, pluggy) are not the user's either.
    assert not any("pluggy" in f.file or "_pytest" in f.file for f in mine)


def test_library_frames_are_dropped_from_a_real_stack():
    flax_linen = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    dense = flax_linen.Dense(4)
    params = dense.init(jax.random.key(0), jnp.ones((2, 8)))
    adam = optax.adam(1e-3)

    def step(params, x):
        y = dense.apply(params, x)  # <- dense
        update, _ = adam.update(params, adam.init(params), params)  # <- adam
        return y, update

    module = parse_hlo(jax.jit(step).lower(params, jnp.ones((2, 8))).compile().as_text())
    for line in (_marker("dense"), _marker("adam")):
        stacks = [i.stack for i in module.instructions() if i.stack and i.stack[0].file != __file__
                  and any(f.line == line and f.file == __file__ for f in i.stack)]
        assert stacks, line  # the library's own frames are innermost
        for stack in stacks:
            kept = user_stack(stack)
            assert kept[0].file == __file__ and kept[0].line == line
            assert not [f for f in kept if any(f"/{lib}/" in f.file for lib in ("flax", "optax"))]
            assert [f for f in kept if f.file == __file__] == [f for f in stack if f.file == __file__]


def _frame(module, line=1) -> Source:
    return Source(os.path.abspath(module.__file__), line)


def test_user_stack_keeps_model_code_and_drops_machinery():
    user = Source("/home/me/model/layers.py", 12)
    stack = (_frame(jax), _frame(jnp), _frame(np), _frame(contextlib), _frame(functools), _frame(_hlo), _frame(_detect),
             _frame(_routing), user, _frame(steps),
             Source("/opt/env/lib/python3.9/site-packages/flax/linen/linear.py", 287),
             Source("/opt/env/lib/python3.9/site-packages/shardlint/gate/_gate.py", 3),
             Source("/opt/env/lib/python3.9/site-packages/maxtext/layers/moe.py", 3969),
             Source("/usr/lib/python3.9/contextlib.py", 79))
    kept = user_stack(stack)
    assert kept == (_frame(_routing), user, _frame(steps), stack[12])


def test_the_console_script_launcher_is_not_a_user_frame():
    # `shardlint analyze ...` runs through the launcher in the environment's scripts
    # folder: outermost on every stack, it must not be shown as the user's line.
    import os
    import sysconfig

    launcher = Source(os.path.join(sysconfig.get_paths()["scripts"], "shardlint"), 8)
    user = Source("/home/me/model.py", 12)
    assert user_stack((user, launcher)) == (user,)


def test_an_all_library_stack_keeps_its_innermost_frame():
    stack = (_frame(jnp, 7), _frame(contextlib, 9))
    assert user_stack(stack) == stack[:1]
    assert user_stack(()) == ()


def test_display_path(tmp_path, monkeypatch):
    site = tmp_path / "env" / "lib" / "python3.12" / "site-packages"
    monkeypatch.syspath_prepend(str(tmp_path / "env" / "lib" / "python3.12"))
    monkeypatch.syspath_prepend(str(site))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert display_path(str(work / "train.py")) == "train.py"
    assert display_path(str(site / "maxtext" / "layers" / "moe.py")) == os.path.join("maxtext", "layers", "moe.py")
    assert display_path("/nowhere/else/model.py") == "/nowhere/else/model.py"
    # A virtual environment inside the project: the package's own path, not `.venv/...`.
    venv_site = work / ".venv" / "lib" / "python3.12" / "site-packages"
    monkeypatch.syspath_prepend(str(venv_site))
    assert display_path(str(venv_site / "maxtext" / "moe.py")) == os.path.join("maxtext", "moe.py")
    assert display_path("<embedded module>") == "<embedded module>"


CHAIN_TEXT = """HloModule m

FileNames
1 "/src/train.py"
2 "/src/layers/moe.py"

FunctionNames
1 "main"
2 "route"

FileLocations
1 {file_name_id=1 function_name_id=1 line=153 end_line=153 column=2 end_column=31}
2 {file_name_id=2 function_name_id=2 line=35 end_line=35 column=2 end_column=24}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}

ENTRY %main () -> pred[] {
  ROOT %constant = pred[] constant(true), metadata={op_type="const" op_name="route" stack_frame_id=2}
}
"""


def test_xla_prints_the_parent_frame_plus_one():
    # XLA's HloModule::Print writes `parent_frame_id() + 1`: a root prints 1, the child of
    # frame 1 prints 2 (the same convention in the modules of JAX 0.10.2 and 0.12.0.1).
    (instr,) = parse_hlo(CHAIN_TEXT).entry.instructions
    assert instr.stack == (Source("/src/layers/moe.py", 35, "route"),
                           Source("/src/train.py", 153, "main"))
    assert instr.op_name == "route"


def test_display_path_of_a_package_off_sys_path_is_relative_to_its_root(tmp_path, monkeypatch):
    # An editable install imports through a finder, not a sys.path entry.
    from shardlint._source import display_path

    (tmp_path / "proj" / "pkg" / "sub").mkdir(parents=True)
    for folder in ("pkg", "pkg/sub"):
        (tmp_path / "proj" / folder / "__init__.py").write_text("")
    module = tmp_path / "proj" / "pkg" / "sub" / "layer.py"
    module.write_text("")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert display_path(str(module)) == "pkg/sub/layer.py"


def test_a_shim_installed_in_place_of_jax_top_k_is_not_the_users_line(monkeypatch, mesh):
    """MaxText replaces `jax.lax.top_k` with a compat shim; the finding and the rewrite's
    seed must name the model's top_k line, not the shim's."""
    import shardlint
    from shardlint import _jax

    from support import cause_steps, jax_compat_shim

    monkeypatch.setattr(jax.lax, "top_k", jax_compat_shim.compat_top_k)
    fn, args = cause_steps.make_scatter_dispatch_step(mesh)
    analysis = shardlint.analyze(fn, *args)
    files = {os.path.basename(f.source.file) for f in analysis.findings if f.op == "top_k"}
    assert files == {"cause_steps.py"}, files
    eqn = next(e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "top_k")
    assert os.path.basename(_jax.user_frame(eqn)[0]) == "cause_steps.py"
