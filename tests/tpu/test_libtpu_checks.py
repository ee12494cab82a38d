"""The checks around TPU AOT that need no libtpu: version pins, the environment libtpu
reads, topology names and the "would not fit" verdict. They run in the default suite so
that a missing or mismatched libtpu is always a clear error, never a compiler crash."""

from __future__ import annotations

import importlib.metadata

import pytest

from shardlint.analyzer import Analysis, Memory
from shardlint.analyzer.memory import _fit as fitting
from shardlint.analyzer.compile import _topology as topo
from shardlint.cli import main
from support.processes import user_env


@pytest.mark.parametrize("version, spec, ok", [
    ("0.0.42.1", "==0.0.42.*", True),
    ("0.0.42", "==0.0.42.*", True),
    ("0.0.52", "==0.0.42.*", False),
    ("0.0.420", "==0.0.42.*", False),
    ("0.0.50.1", ">=0.0.50,<0.0.51", True),
    ("0.0.51", ">=0.0.50,<0.0.51", False),
    ("0.0.42.1", "!=0.0.42.*", False),
    ("1.4.2", "~=1.4", True),
    ("2.0", "~=1.4", False),
    ("0.0.42", "==0.0.42.0", True),
])
def test_version_specifiers(version, spec, ok):
    assert topo.satisfies(version, spec) is ok


def test_required_libtpu_is_read_from_jax_metadata():
    wanted = topo.required_libtpu()
    reqs = importlib.metadata.requires("jax") or []
    pinned = [r for r in reqs if r.replace(" ", "").startswith("libtpu") and "tpu" in r.split(";")[-1]]
    if not pinned:
        assert wanted is None
    else:
        assert wanted and wanted in pinned[0].replace(" ", "")


def _no_library_path(monkeypatch):
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)


def test_missing_libtpu_names_the_pin_and_the_install_command(monkeypatch):
    _no_library_path(monkeypatch)
    monkeypatch.setattr(topo, "libtpu_version", lambda: None)
    monkeypatch.setattr(topo, "required_libtpu", lambda: "==0.0.42.*")
    with pytest.raises(topo.LibtpuError) as e:
        topo.check_libtpu()
    msg = str(e.value)
    assert "not installed" in msg and "libtpu==0.0.42.*" in msg
    assert "pip install 'shardlint[tpu]'" in msg
    assert importlib.metadata.version("jax") in msg


def test_mismatched_libtpu_names_both_versions(monkeypatch):
    _no_library_path(monkeypatch)
    monkeypatch.setattr(topo, "libtpu_version", lambda: "0.0.52")
    monkeypatch.setattr(topo, "required_libtpu", lambda: "==0.0.42.*")
    with pytest.raises(topo.LibtpuError) as e:
        topo.check_libtpu()
    msg = str(e.value)
    assert "libtpu 0.0.52 is installed" in msg and "libtpu==0.0.42.*" in msg
    assert "pip install 'libtpu==0.0.42.*'" in msg


def test_cli_mismatch_is_one_line_exit_2(monkeypatch, capsys):
    _no_library_path(monkeypatch)
    monkeypatch.setattr(topo, "libtpu_version", lambda: "0.0.52")
    monkeypatch.setattr(topo, "required_libtpu", lambda: "==0.0.42.*")
    code = main(["analyze", "shardlint.examples.steps:make_step", "--topology", "v5p:2x2x1",
                 "--mesh", "data=1,context=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("shardlint: error: libtpu 0.0.52 is installed")
    assert not any("Traceback" in line or "RET_CHECK" in line for line in err)


def test_cli_bad_topology_name_exit_2(capsys):
    code = main(["analyze", "shardlint.examples.steps:make_step", "--topology", "v5p-8",
                 "--mesh", "data=1,context=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "cannot read 'v5p-8'" in err[-1] and "v5p:2x2x1" in err[-1]


def test_environment_is_set_for_a_host_without_metadata_server(monkeypatch):
    for key in ("TPU_SKIP_MDS_QUERY", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES",
                "TPU_WORKER_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "mine")   # the user's own value wins
    set_here = topo.tpu_environment("v5p:2x2x1")
    import os

    assert os.environ["TPU_SKIP_MDS_QUERY"] == "1"
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5p-8"
    assert os.environ["TPU_WORKER_ID"] == "0"
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "mine" and "TPU_WORKER_HOSTNAMES" not in set_here


@pytest.mark.parametrize("name, accel", [("v5p:2x2x1", "v5p-8"), ("v4:2x2x2", "v4-16"),
                                         ("v5e:2x2", "v5litepod-4"), ("v6e:4x4", "v6e-16")])
def test_accelerator_types(name, accel):
    assert topo.accelerator_type(name) == accel


@pytest.mark.parametrize("name", ["v5p", "2x2x1", "v5p:2x2x", "v5p:0x2x1", "tpu:2x2"])
def test_bad_topology_names(name):
    with pytest.raises(topo.TopologyError, match="--topology"):
        topo.parse_topology(name)


def _analysis(memory: Memory, topology: str | None) -> Analysis:
    return Analysis(mesh={"context": 4}, memory=memory, collectives=(), findings=(),
                    requested=(), versions={"jax": "x"}, partitioner="shardy",
                    platform="tpu" if topology else "cpu", topology=topology)


GIB = 2 ** 30


def test_fit_defaults_to_the_chips_hbm():
    mem = Memory(argument_bytes=10 * GIB, output_bytes=2 * GIB, temp_bytes=5 * GIB,
                 alias_bytes=0, peak_bytes=None, flops=None)
    fit = fitting.fit_of(_analysis(mem, "v5e:2x2"))
    assert not fit.fits and fit.need_bytes == 17 * GIB and fit.limit_bytes == 16 * GIB
    assert fit.line() == ("would not fit: needs 17.00 GiB per device > 16.00 GiB (v5e HBM per "
                          "chip): arguments 10.00 GiB + outputs 2.00 GiB + temp 5.00 GiB = 17.00 GiB")
    assert fitting.fit_of(_analysis(mem, "v5p:2x2x1")).fits  # 95 GiB
    assert fitting.fit_of(_analysis(mem, None)) is None      # CPU, no limit given
    assert not fitting.fit_of(_analysis(mem, None), 16).fits


def test_fit_counts_aliased_outputs_once_and_takes_the_peak_when_larger():
    donated = Memory(argument_bytes=8 * GIB, output_bytes=8 * GIB, temp_bytes=1 * GIB,
                     alias_bytes=8 * GIB, peak_bytes=None, flops=None)
    fit = fitting.fit_of(_analysis(donated, "v5e:2x2"))
    assert fit.fits and fit.need_bytes == 9 * GIB and "- aliased 8.00 GiB" in fit.line()
    # v4/v5e report temporaries only in the peak.
    peaky = Memory(argument_bytes=GIB, output_bytes=GIB, temp_bytes=0, alias_bytes=0,
                   peak_bytes=20 * GIB, flops=None)
    fit = fitting.fit_of(_analysis(peaky, "v4:2x2x1"))
    assert fit.need_bytes == 20 * GIB and "compiler's peak 20.00 GiB" in fit.line()
    assert fit.fits  # v4: 32 GiB


def test_hbm_table_and_bad_limit():
    assert [fitting.hbm_gib(t) for t in ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2", "v9:1x1")] \
        == [32, 16, 95, 32, None]
    mem = Memory(argument_bytes=1, output_bytes=1, temp_bytes=1, alias_bytes=0, peak_bytes=None, flops=None)
    with pytest.raises(topo.TopologyError, match="--hbm-gib must be > 0"):
        fitting.fit_of(_analysis(mem, None), 0)


@pytest.mark.tpu
@pytest.mark.parametrize("xla_flags", ["", "--xla_force_host_platform_device_count=8"])
def test_cpu_commands_print_nothing_from_libtpu(xla_flags):
    # With shardlint[tpu] installed, a CPU command must not start the TPU client: libtpu
    # would print its start-up errors ("Failed to find host bounds", "unexpected worker
    # hostname") on every run. Also when the device count comes from XLA_FLAGS.
    import subprocess
    import sys

    env = user_env(xla_flags, drop=("JAX_PLATFORMS",))
    proc = subprocess.run([sys.executable, "-m", "shardlint.cli", "analyze", "shardlint.examples.steps:make_step",
                           "--mesh", "data=2,context=4"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]   # the example's findings
    assert [line for line in proc.stderr.splitlines() if not line.startswith("shardlint: ")] == []
