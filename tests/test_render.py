"""`antman config render`: the Slurm fragments, checked for content and accepted by real Slurm tools."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_antman import config
from slurm_antman.render import RenderOptions, render_all

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cfg():
    return config.parse({
        "grace_time_s": 45,
        "default_class": "opportunistic",
        "plugin_path": "/opt/antman/antman_spank.so",
        "state_dir": "/var/lib/antman",
        "slurm": {"opportunistic_qos": "scavenger"},
        "opportunistic": {"slots_per_gpu": 3},
        "nodes": [{"name": "a[1-2]", "gpus": 8, "cpus": 32, "memory_mb": 1000},
                  {"name": "b1", "gpus": 2, "gpu_files": "/dev/nv[0-1]"}],
    })


def test_slurm_fragment(cfg):
    frag = render_all(cfg, RenderOptions(config_path="/etc/antman.yaml", hook_dir="/usr/libexec/antman"))[
        "antman.slurm.conf"]
    assert "GresTypes=gpu,antman_opp" in frag
    assert re.search(r"^NodeName=a1 CPUs=32 RealMemory=1000 Gres=gpu:8,antman_opp:24 ", frag, re.M)
    assert re.search(r"^NodeName=b1 .*Gres=gpu:2,antman_opp:6 ", frag, re.M)
    assert re.search(r"^PartitionName=gpu Nodes=a1,a2,b1 Default=YES PriorityTier=10 PreemptMode=OFF", frag, re.M)
    assert re.search(r"^PartitionName=opportunistic .*PriorityTier=1 PreemptMode=REQUEUE GraceTime=45", frag, re.M)
    assert "PreemptType=preempt/partition_prio" in frag
    assert "SlurmctldParameters=preempt_send_user_signal" in frag
    assert "JobSubmitPlugins=lua" in frag and "PrologFlags=Alloc" in frag
    assert "Prolog=/usr/libexec/antman/antman-prolog" in frag


def test_plain_render_has_no_antman_stack(cfg):
    files = render_all(cfg, RenderOptions(with_antman=False))
    assert set(files) == {"antman.slurm.conf", "gres.conf"}
    assert "JobSubmitPlugins" not in files["antman.slurm.conf"] and "Prolog" not in files["antman.slurm.conf"]


def test_gres_plugstack_and_settings(cfg):
    files = render_all(cfg)
    gres = files["gres.conf"]
    assert "NodeName=a[1-2] Name=gpu File=/dev/nvidia[0-7]" in gres
    assert "NodeName=a[1-2] Name=antman_opp Count=24" in gres
    assert "NodeName=b1 Name=gpu File=/dev/nv[0-1]" in gres
    # No absolute hook_dir: the plugin gets no prolog= (it would refuse a relative one) and says why.
    plug = files["plugstack.conf.d/antman.conf"].splitlines()
    assert plug[-1] == "required /opt/antman/antman_spank.so state_dir=/var/lib/antman opp_partition=opportunistic"
    assert plug[-2].startswith("# no prolog=: hook_dir '.'")


def test_plugstack_names_the_prolog_for_restarts(cfg):
    files = render_all(cfg, RenderOptions(hook_dir="/usr/libexec/antman"))
    assert files["plugstack.conf.d/antman.conf"].splitlines()[-1] == (
        "required /opt/antman/antman_spank.so state_dir=/var/lib/antman "
        "prolog=/usr/libexec/antman/antman-prolog opp_partition=opportunistic")
    # The same hook slurm.conf names as the Prolog.
    assert "Prolog=/usr/libexec/antman/antman-prolog" in files["antman.slurm.conf"]
    spaced = render_all(cfg, RenderOptions(hook_dir="/opt/my hooks"))["plugstack.conf.d/antman.conf"]
    assert "prolog=" not in spaced.splitlines()[-1]


def test_settings_lua_is_what_the_script_reads(cfg, tmp_path):
    lua = render_all(cfg)["antman_settings.lua"]
    f = tmp_path / "s.lua"
    f.write_text(lua)
    probe = ('local s = dofile(arg[1]); print(s.default_class, s.auto_class, s.gpu_gres, s.opp_gres, '
             's.guaranteed_partition, s.opp_partition, s.opp_qos, type(s.max_node_gpus), '
             's.max_node_gpus)')
    r = subprocess.run(["lua5.1", "-e", probe.replace("arg[1]", repr(str(f)))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # max_node_gpus: the largest group's GPUs (a[1-2] has 8, b1 2), a number
    assert r.stdout.split() == ["opportunistic", "opportunistic", "gpu", "antman_opp", "gpu", "opportunistic",
                                "scavenger", "number", "8"]


def test_auto_is_guaranteed_when_default_is_none():
    cfg = config.parse({"nodes": [{"name": "n1", "gpus": 1}]})
    assert 'auto_class = "guaranteed"' in render_all(cfg)["antman_settings.lua"]


def test_hook_script_runs_antman_node(cfg):
    opts = RenderOptions(config_path="/etc/a b/antman.yaml", slurm_conf="/etc/slurm/slurm.conf")
    script = render_all(cfg, opts)["antman-prolog"]
    assert script.startswith("#!/bin/sh\n")
    assert "export SLURM_CONF=/etc/slurm/slurm.conf" in script
    assert script.rstrip().endswith("node prolog --config '/etc/a b/antman.yaml'")


def test_cli_render_writes_files_slurmd_accepts(tmp_path):
    """Render the example site and let Slurm's own slurmd parse the result (-C prints its view)."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "config", "render", str(REPO / "etc/antman.yaml"),
                        "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert names == {"antman.slurm.conf", "gres.conf", "plugstack.conf.d/antman.conf", "antman_settings.lua",
                     "antman-prolog", "antman-epilog"}
    assert os.access(out / "antman-prolog", os.X_OK)
    slurm_conf = tmp_path / "slurm.conf"
    slurm_conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        f"Include {out}/antman.slurm.conf\n")
    # scontrol parses the whole configuration without a controller: a bad line fails here.
    r = subprocess.run(["scontrol", "show", "hostnames", "gpu[01-02]"], capture_output=True, text=True,
                       env={**os.environ, "SLURM_CONF": str(slurm_conf)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["gpu01", "gpu02"]


def test_site_node_params_reach_the_node_lines():
    cfg = config.parse({"nodes": [{"name": "g[1-2]", "gpus": 2, "slurm_params": "Sockets=2 CoresPerSocket=4"}]})
    frag = render_all(cfg, RenderOptions(node_params={"g2": "Port=7001"}))["antman.slurm.conf"]
    assert re.search(r"^NodeName=g1 .* State=UNKNOWN Sockets=2 CoresPerSocket=4$", frag, re.M)
    assert re.search(r"^NodeName=g2 .* State=UNKNOWN Sockets=2 CoresPerSocket=4 Port=7001$", frag, re.M)
    with pytest.raises(config.ConfigError) as e:
        config.parse({"nodes": [{"name": "g1", "gpus": 1, "slurm_params": "Sockets=2\nEvil"}]})
    assert "nodes.0.slurm_params" in str(e.value)
