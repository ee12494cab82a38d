"""`--sweep KEY=v1,v2,...` on `analyze` and `report`: over a mesh axis or a target option,
each point's temp against its ideal, and the lines that hold what does not shrink.

The example step flattens (batch, seq) with the sequence sharded over context: XLA gathers
the whole sequence at the flatten, so the tokens' buffers do not shrink with the context
degree. Swept over the mesh's context axis (devices grow with it, so the activations each
device is handed shrink like 1/N and so should temp), and over an option of a target that
trades data for context on 8 devices (the activations per device stay, so should temp).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardlint.cli import main
from support.processes import user_env

TARGET = "shardlint.examples.steps:make_step"
TRADING = '''
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def make_step(mesh, context=1):
    """context x data = 8 devices: the tokens each device is handed stay the same. The
    flatten before the matmul loses the sequence sharding once context > 1."""
    mesh = jax.make_mesh((8 // context, context), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((8, 512, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", "context", None)))
    w = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P()))

    def step(w_DF, x_BSD):
        def loss(w_DF):
            b, s, d = x_BSD.shape
            tokens_TD = x_BSD.reshape(b * s, d)
            return jnp.mean(jax.nn.relu(tokens_TD @ w_DF) ** 2)
        return jax.value_and_grad(loss)(w_DF)

    return step, (w, x)
'''


def _line(snippet: str) -> int:
    return next(i for i, text in enumerate(TRADING.splitlines(), 1) if snippet in text)


@pytest.fixture(scope="module")
def mesh_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "sweep.json"
    code = main(["analyze", TARGET, "--mesh", "data=2,context=4", "--sweep", "context=1,2,4",
                 "--json", str(out)])
    return code, json.loads(out.read_text())


def test_a_mesh_axis_sweep_names_the_lines_that_do_not_shrink(mesh_sweep):
    code, doc = mesh_sweep
    assert code == 1   # the step loses the sequence sharding at every sharded point
    sweep = doc["sweep"]
    assert doc["schema"] == "shardlint.report-data/1" and sweep["key"] == "context"
    assert sweep["values"] == [1, 2, 4]
    before = sweep["before"]
    temps = [p["before"]["temp_bytes"] for p in sweep["points"]]
    assert before["temp"] == temps and before["ideal"][0] == temps[0]
    # devices grow with context here: the ideal falls like 1/N
    assert before["ideal"][-1] == round(temps[0] / 4)
    assert temps[-1] > 2 * before["ideal"][-1]
    listed = before["lines"][:before["listed"]]
    assert listed and all(line["scaling"] in ("flat", "grows") for line in listed)
    assert all(line["source"]["file"] == "shardlint/examples/steps.py" for line in listed)
    assert before["above_ideal_explained"] >= 0.9
    assert "that does not shrink" in before["headline"]
    for point in sweep["points"]:
        buffers = point["before"]["peak_buffers"]
        accounted = sum(b["bytes"] for b in buffers if b["role"] == "temp")
        assert accounted >= 0.95 * point["before"]["temp_bytes"]


def test_the_sweep_runs_on_the_plans_engine_with_the_same_points(tmp_path):
    """`--jobs 2`: each point in a process of its own (`commands._engine`, the plan's), the
    same sweep, frames and lines included, as one after another in the command's process."""
    docs = []
    for jobs in ("0", "2"):
        out = tmp_path / f"sweep-{jobs}.json"
        done = subprocess.run([sys.executable, "-m", "shardlint", "analyze", TARGET, "--mesh", "data=2,context=4",
                               "--sweep", "context=1,2", "--jobs", jobs, "--json", str(out)],
                              env=user_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 1, done.stderr[-2000:]     # the step loses the sharding
        docs.append(json.loads(out.read_text())["sweep"])
    assert docs[0] == docs[1]


def test_the_sweep_is_printed_with_its_headline(capsys):
    code = main(["analyze", TARGET, "--mesh", "data=2,context=2", "--sweep", "context=1,2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "swept over context=1,2" in out and "ideal" in out
    assert "context 2: temp" in out and "steps.py" in out


@pytest.fixture(scope="module")
def option_sweep(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trading")
    (folder / "trading.py").write_text(TRADING)
    out = folder / "report.json"
    code = main(["report", f"{folder / 'trading.py'}:make_step", "--devices", "8",
                 "--sweep", "context=1,2,4", "--out", str(folder / "report.html"), "--json", str(out)])
    return code, json.loads(out.read_text()), (folder / "report.html").read_text()


def test_an_option_sweep_keeps_the_devices_and_expects_flat_memory(option_sweep):
    code, doc, _ = option_sweep
    assert code == 1
    sweep = doc["sweep"]
    assert [p["value"] for p in sweep["points"]] == [1, 2, 4]
    before, after = sweep["before"], sweep["after"]
    # 8 devices at every point, the tokens per device unchanged: the ideal is flat
    assert len(set(before["ideal"])) == 1
    assert before["temp"][-1] > 1.5 * before["ideal"][-1]
    listed = before["lines"][:before["listed"]]
    assert any(line["scaling"] == "grows" for line in listed)
    assert {line["source"]["line"] for line in listed if line["source"]} & {_line("tokens_TD @ w_DF"),
                                                                             _line("x_BSD.reshape")}
    # JAX 0.12's XLA:CPU copies the gathered argument in a fusion with no source line: named after it
    assert all(line["source"] or line["name"] == "x_BSD" for line in listed)
    assert before["above_ideal_explained"] >= 0.9
    # no routed layer: nothing to rewrite, the step runs as it is at every point
    assert after["temp"] == before["temp"] and doc["before"]["findings"]


def test_the_report_draws_the_scaling_and_the_peak(option_sweep, parse):
    _, doc, html = option_sweep
    page = parse(html)
    headline = page.find(data_scaling="before the rewrite")
    assert headline is not None and "that does not shrink" in headline.text()
    assert page.find_all("table", **{"class": "grid scaling-table"})
    assert page.find("table", data_side="before") is not None   # temp at the peak, by line



@pytest.mark.parametrize("argv,message", [
    (["--sweep", "nothing=1,2"], "--sweep nothing: neither an axis of --mesh"),
    (["--sweep", "context=1,2", "--set", "context=2"], "give its values in --sweep only"),
])
def test_sweep_mistakes_are_one_line(argv, message, tmp_path, capsys):
    (tmp_path / "trading.py").write_text(TRADING)
    assert main(["analyze", f"{tmp_path / 'trading.py'}:make_step", "--devices", "8", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
