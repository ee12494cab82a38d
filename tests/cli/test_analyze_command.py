"""`shardlint analyze`: exit codes, output order, JSON, and one-line errors."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

import shardlint
from shardlint.cli import main

TARGET = "shardlint.examples.steps:make_step"


def test_findings_exit_1_and_json_matches_stdout(capsys, tmp_path):
    out = tmp_path / "a.json"
    code = main(["analyze", TARGET, "--mesh", "data=2,context=4", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    doc = json.loads(out.read_text())
    assert doc["schema"] == "shardlint.analysis/3" and doc["mesh"] == {"data": 2, "context": 4}
    text = captured.out
    # Findings first, then collectives, then memory.
    assert text.index("finding(s)") < text.index("collective(s)") < text.index("memory per device")
    for f in doc["findings"]:  # shown relative to the working directory
        assert f"{os.path.relpath(f['source']['file'])}:{f['source']['line']}" in text
    assert "compiling" in captured.err  # progress goes to stderr


def test_clean_step_exits_0(capsys):
    assert main(["analyze", "shardlint.examples.steps:make_per_shard_step", "--mesh", "data=2,context=4"]) == 0
    assert "no findings" in capsys.readouterr().out


def test_file_target_puts_its_folder_on_sys_path(tmp_path, capsys):
    (tmp_path / "helper_mod.py").write_text("from shardlint.examples.steps import make_dense_step as make\n")
    (tmp_path / "model.py").write_text("import helper_mod\n\ndef make_step(mesh):\n    return helper_mod.make(mesh)\n")
    code = main(["analyze", f"{tmp_path / 'model.py'}:make_step", "--mesh", "data=2,context=4"])
    assert code == 1
    assert "reshape drops context" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["analyze", TARGET, "--mesh", "data=2,context"], "cannot read 'context'"),
    (["analyze", TARGET, "--mesh", "data=2,data=4"], "given twice"),
    (["analyze", "no_such_module_xyz:make", "--mesh", "data=2"], "cannot import"),
    (["analyze", "shardlint.examples.steps:nope", "--mesh", "data=2"], "no attribute 'nope'"),
    (["analyze", "missing_file.py:make", "--mesh", "data=2"], "no file"),
    (["analyze", "shardlint.examples.steps", "--mesh", "data=2"], "write path/to/model.py:make_step"),
])
def test_usage_errors_are_one_line_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("shardlint: error:") and message in err[-1]
    assert not any("Traceback" in line for line in err)


def test_target_that_raises_and_mesh_mismatch(tmp_path, capsys):
    (tmp_path / "bad.py").write_text(textwrap.dedent("""
        import jax
        from jax.sharding import AxisType
        from shardlint.examples import steps

        def raises(mesh):
            raise RuntimeError("model config missing")

        def other_mesh(mesh):
            mine = jax.make_mesh((4, 2), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
            return steps.make_step(mine)

        def broken_step(mesh):
            fn, args = steps.make_step(mesh)
            return (lambda params, x: x @ x), args
    """))
    assert main(["analyze", f"{tmp_path}/bad.py:raises", "--mesh", "data=2,context=4"]) == 2
    assert "model config missing" in capsys.readouterr().err
    assert main(["analyze", f"{tmp_path}/bad.py:other_mesh", "--mesh", "data=2,context=4"]) == 2
    assert "not the --mesh" in capsys.readouterr().err
    assert main(["analyze", f"{tmp_path}/bad.py:broken_step", "--mesh", "data=2,context=4"]) == 2
    assert "tracing the step failed" in capsys.readouterr().err


def test_cli_simulates_the_devices_the_mesh_needs(tmp_path, run_cli):
    # A fresh process: 16 devices are asked for from --mesh before JAX starts.
    result = run_cli("analyze", "shardlint.examples.steps:make_per_shard_step",
                     "--mesh", "data=2,context=8", "--json", str(tmp_path / "a.json"))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "a.json").read_text())["mesh"] == {"data": 2, "context": 8}


def test_rewrite_flag_fixes_the_step_and_refuses_what_is_unsafe(capsys, tmp_path):
    out = tmp_path / "after.json"
    code = main(["analyze", TARGET, "--mesh", "data=2,context=4", "--rewrite", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "verifying the rewrite" in captured.err
    doc = json.loads(out.read_text())
    assert doc["findings"] == [] and not [c for c in doc["collectives"] if c["kind"] == "all-gather"]
    code = main(["analyze", "shardlint.examples.steps:make_capacity_step", "--mesh", "data=2,context=4", "--rewrite"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "cumsum over the token dimension at shardlint/examples/steps.py:108 couples all tokens" in err[-1]


OWN_MESH_TARGET = textwrap.dedent('''
    import jax
    from jax.sharding import AxisType
    from shardlint.examples.steps import make_step as make

    def make_step(mesh):
        assert mesh is None  # --devices: the target builds its own mesh
        own = jax.make_mesh((2, 1, 4), ("data", "stage", "context"), axis_types=(AxisType.Auto,) * 3)
        return make(own)
''')


def test_devices_calls_the_target_with_no_mesh_and_reports_its_own(tmp_path, run_cli):
    (tmp_path / "own_mesh.py").write_text(OWN_MESH_TARGET)
    out = tmp_path / "a.json"
    done = run_cli("analyze", f"{tmp_path / 'own_mesh.py'}:make_step", "--devices", "8", "--json", str(out))
    assert done.returncode == 1, done.stderr  # the example has findings
    assert json.loads(out.read_text())["mesh"] == {"data": 2, "stage": 1, "context": 4}
    header = done.stdout.splitlines()[0]
    assert "on mesh data=2 x context=4 " in header  # size-1 axes left out


@pytest.mark.parametrize("argv, message", [
    (["--devices", "8", "--mesh", "data=8"], "not allowed with argument"),
    (["--devices", "0"], "--devices 0"),
])
def test_devices_usage_errors(argv, message, capsys):
    assert main(["analyze", TARGET, *argv]) == 2
    assert message in capsys.readouterr().err


def test_set_passes_keyword_arguments_parsed_as_json(tmp_path, capsys):
    """`--set layers=2 --set remat=false` reach make_scanned_step(mesh, layers=2, remat=False):
    the loop runs 2 times, and without remat its collectives are fewer."""
    out = tmp_path / "a.json"
    target = "shardlint.examples.steps:make_scanned_step"
    argv = ["analyze", target, "--mesh", "data=2,context=4", "--json", str(out)]
    assert main(argv + ["--set", "layers=2", "--set", "remat=false"]) == 1
    looped = [c for c in json.loads(out.read_text())["collectives"] if c["trips"] != 1]
    assert looped and {c["trips"] for c in looped} == {2}
    assert main(argv + ["--set", "layers=2"]) == 1
    with_remat = [c for c in json.loads(out.read_text())["collectives"] if c["trips"] != 1]
    assert len(with_remat) > len(looped)


@pytest.mark.parametrize("argv, message", [
    (["--set", "layer=2"], "target 'shardlint.examples.steps:make_scanned_step' takes no option 'layer' "
                           "(--set layer=...); it takes sizes, layers, remat"),
    (["--set", "layers"], "--set 'layers': write key=value"),
    (["--set", "layers=2", "--set", "layers=3"], "--set: 'layers' is given twice"),
])
def test_set_mistakes_are_one_line(argv, message, capsys):
    assert main(["analyze", "shardlint.examples.steps:make_scanned_step", "--mesh", "data=2,context=4", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"shardlint: error: {message}" or err[-1].startswith(f"shardlint: error: {message}")


def test_a_mesh_is_needed_from_somewhere(capsys):
    assert main(["analyze", TARGET]) == 2
    assert "give --mesh AXES (the target gets that mesh), --devices N" in capsys.readouterr().err


# Where the OS says no: a missing folder, a file where a folder should be, a folder where
# a file should be, and /proc, which takes no new files even from root (permission bits
# would let root write anywhere; the path is tried).
UNWRITABLE = [
    ("{missing}/out.json", "the folder {missing} does not exist"),
    ("{file}/out.json", "{file} is a file, not a folder"),
    ("{tmp}", "it is a folder"),
    ("/proc/shardlint-out.json", "/proc takes no new files"),
]


@pytest.mark.parametrize("path, why", UNWRITABLE)
@pytest.mark.parametrize("argv, what", [
    (["analyze", TARGET, "--mesh", "data=2,context=4", "--json"], "the analysis"),
    (["analyze", TARGET, "--mesh", "data=2,context=4", "--sweep", "context=2,4", "--json"], "the analysis"),
    (["report", TARGET, "--mesh", "data=2,context=4", "--out"], "the report"),
    (["report", TARGET, "--mesh", "data=2,context=4", "--json"], "the report's data"),
    (["check", TARGET, "--mesh", "data=2,context=4", "--update", "--baseline"], "the baseline"),
])
def test_unwritable_outputs_fail_first_in_one_line(argv, what, path, why, capsys, tmp_path, monkeypatch):
    if path.startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    monkeypatch.chdir(tmp_path)   # report's default --out lands here
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    names = {"missing": tmp_path / "missing", "file": a_file, "tmp": tmp_path}
    path, why = path.format(**names), why.format(**names)
    assert main([*argv, path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # one line, and no other: nothing was traced or compiled first
    assert err == [f"shardlint: error: cannot write {what} to {path}: {why}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("out, why", [
    ("{file}/demo", "{file} is a file, not a folder"),
    ("{file}", "it is a file, not a folder"),
    ("/proc/shardlint-demo", "/proc takes no new files"),
])
def test_the_demo_refuses_an_unwritable_folder_first_and_makes_none(out, why, capsys, tmp_path):
    if out.startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out, why = out.format(file=a_file), why.format(file=a_file)
    assert main(["demo", "--out", out]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"shardlint: error: cannot write the demo's report to {out}: {why}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_nothing_to_rewrite_is_one_line_and_the_exit_code_of_a_plain_analyze(capsys, recwarn):
    """A flatten before a dense MLP loses context but feeds no routed experts: `--rewrite`
    has nothing to do, says so once, and the output is the plain analysis's."""
    dense = ["analyze", "shardlint.examples.steps:make_dense_step", "--mesh", "data=2,context=4"]
    plain = main(dense)
    plain_out = capsys.readouterr().out
    code = main([*dense, "--rewrite"])
    captured = capsys.readouterr()
    assert code == plain == 1
    said = [line for line in captured.err.splitlines() if "nothing to rewrite" in line]
    assert len(said) == 1 and said[0].startswith("shardlint: nothing to rewrite: ")
    assert "NothingToRewrite" not in captured.err
    assert not [w for w in recwarn if issubclass(w.category, shardlint.NothingToRewrite)]
    assert "(rewritten)" not in captured.out
    assert captured.out == plain_out


USER_ERRORS = textwrap.dedent("""
    from shardlint.examples import steps

    def layer(params, x):
        return x @ params["w_out"]   # <- wrong contraction

    def make_step(mesh):
        _, args = steps.make_step(mesh)
        return (lambda params, x: layer(params, x).sum()), args

    def make_broken(mesh):
        config = {}
        return config["layers"]   # <- missing key
""")


def test_an_error_in_the_users_code_names_its_line_and_traceback_shows_all(tmp_path, capsys):
    path = tmp_path / "user_errors.py"
    path.write_text(USER_ERRORS)
    lines = USER_ERRORS.splitlines()
    wrong = next(i for i, line in enumerate(lines, 1) if "# <- wrong" in line)
    missing = next(i for i, line in enumerate(lines, 1) if "# <- missing" in line)
    mesh = ["--mesh", "data=2,context=4"]
    assert main(["analyze", f"{path}:make_step", *mesh]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # the file as findings show it: relative to the folder the target's file put on sys.path
    assert err[-1].startswith(f"shardlint: error: tracing the step failed at user_errors.py:{wrong} in layer "
                              f"(return x @ params[\"w_out\"] # <- wrong contraction): TypeError: dot_general")
    assert err[-1].endswith("(--traceback shows the whole traceback)")
    assert not any("Traceback (most recent call last)" in line for line in err)
    assert main(["analyze", f"{path}:make_broken", *mesh]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"shardlint: error: target '{path}:make_broken' raised KeyError at "
                              f"user_errors.py:{missing} in make_broken (return config[\"layers\"] # <- missing key): 'layers'")

    assert main(["analyze", f"{path}:make_step", *mesh, "--traceback"]) == 2
    err = capsys.readouterr().err
    first = err.strip().splitlines()
    assert any(line.startswith("shardlint: error: tracing the step failed at") and "--traceback" not in line
               for line in first)
    assert "Traceback (most recent call last)" in err
    assert f'File "{path}", line {wrong}, in layer' in err   # the user's frame in the traceback
    assert "TypeError: dot_general requires contracting dimensions" in err


def test_target_returning_the_wrong_shape_says_what_it_got(tmp_path, capsys):
    (tmp_path / "shapes.py").write_text(textwrap.dedent("""
        from shardlint.examples import steps

        def named_step(mesh):
            fn, args = steps.make_step(mesh)
            return "step", args

        def just_args(mesh):
            return steps.make_step(mesh)[1][0]
    """))
    assert main(["analyze", f"{tmp_path}/shapes.py:named_step", "--mesh", "data=2,context=4"]) == 2
    err = capsys.readouterr().err
    assert "its first item must be the step function, got str 'step'" in err
    assert main(["analyze", f"{tmp_path}/shapes.py:just_args", "--mesh", "data=2,context=4"]) == 2
    assert "must return (step_fn, args), got dict {" in capsys.readouterr().err
