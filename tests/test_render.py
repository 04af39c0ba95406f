"""`antman config render`: the Slurm fragments, checked for content and accepted by real Slurm tools."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_antman import config
from slurm_antman.admin.render import RenderOptions, render_all

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


SITE_WIDE = ("GresTypes", "PreemptType", "PreemptMode", "SlurmctldParameters", "JobSubmitPlugins", "CliFilterPlugins",
             "PrologFlags", "Prolog", "Epilog", "AccountingStorageTRES")


def _keys(text: str) -> set[str]:
    """The slurm.conf keys a fragment sets, each first word of its lines (not comments)."""
    return {line.split("=", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_slurm_fragment_holds_only_what_antman_owns(cfg):
    frag = render_all(cfg, RenderOptions(config_path="/etc/antman.yaml", hook_dir="/usr/libexec/antman"))[
        "antman.slurm.conf"]
    assert re.search(r"^NodeName=a1 CPUs=32 RealMemory=1000 Gres=gpu:8,antman_opp:24 ", frag, re.M)
    assert re.search(r"^NodeName=b1 .*Gres=gpu:2,antman_opp:6 ", frag, re.M)
    assert re.search(r"^PartitionName=gpu Nodes=a1,a2,b1 Default=YES PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE "
                     r"State=UP$", frag, re.M)
    assert re.search(r"^PartitionName=opportunistic .*PriorityTier=1 PreemptMode=REQUEUE GraceTime=45", frag, re.M)
    # An Include'd value of a site-wide key would replace the site's own (the last one wins): none here.
    assert _keys(frag) == {"NodeName", "PartitionName"}


def test_needed_lists_every_site_wide_key_with_its_rule(cfg):
    needed = render_all(cfg, RenderOptions(hook_dir="/usr/libexec/antman"))["slurm.conf.needed"]
    assert _keys(needed) == set(SITE_WIDE)
    for line in ("GresTypes=gpu,antman_opp", "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
                 "SlurmctldParameters=preempt_send_user_signal", "JobSubmitPlugins=lua",
                 "CliFilterPlugins=cli_filter/lua", "PrologFlags=Alloc", "Prolog=/usr/libexec/antman/antman-prolog",
                 "Epilog=/usr/libexec/antman/antman-epilog", "AccountingStorageTRES=gres/gpu,gres/antman_opp"):
        assert line in needed.splitlines(), line
    assert "# SlurmctldParameters must list preempt_send_user_signal:" in needed
    assert "NOT for Include" in needed and "antman config merge-slurm-conf" in needed
    # A renamed GRES is what the site must list.
    renamed = config.parse({"slurm": {"gpu_gres": "gpgpu", "opportunistic_gres": "slots"},
                            "nodes": [{"name": "n1", "gpus": 1}]})
    assert "GresTypes=gpgpu,slots" in render_all(renamed)["slurm.conf.needed"]


def test_plain_render_has_no_antman_stack(cfg):
    files = render_all(cfg, RenderOptions(with_antman=False))
    assert set(files) == {"antman.slurm.conf", "slurm.conf.needed", "gres.conf"}
    assert _keys(files["slurm.conf.needed"]) == {"GresTypes", "PreemptType", "PreemptMode", "AccountingStorageTRES"}


def test_partition_options_reach_the_partition_lines():
    cfg = config.parse({"slurm": {"default_partition": "cpu", "opportunistic_qos": "scavenger", "partitions": {
        "guaranteed": {"max_time": "7-00:00:00", "default_time": "1:00:00", "allow_accounts": ["vision", "nlp"],
                       "qos": "gpu_normal", "max_nodes": 4},
        "opportunistic": {"max_time": "2-0", "allow_qos": ["scavenger", "normal"], "default": True,
                          "slurm_params": "OverSubscribe=NO ExclusiveUser=YES"},
    }}, "nodes": [{"name": "n1", "gpus": 1}]})
    frag = render_all(cfg)["antman.slurm.conf"]
    assert ("PartitionName=gpu Nodes=n1 Default=NO PriorityTier=10 PreemptMode=OFF MaxTime=7-00:00:00 "
            "DefaultTime=1:00:00 AllowAccounts=vision,nlp QOS=gpu_normal MaxNodes=4 State=UP") in frag.splitlines()
    assert ("PartitionName=opportunistic Nodes=n1 Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=30 "
            "MaxTime=2-0 AllowQos=scavenger,normal State=UP OverSubscribe=NO ExclusiveUser=YES") in frag.splitlines()


@pytest.mark.parametrize("partitions, where, words", [
    ({"guaranteed": {"max_time": "7 days"}}, "slurm.partitions.guaranteed.max_time", "is not a Slurm time"),
    ({"guaranteed": {"max_time": 60}}, "slurm.partitions.guaranteed.max_time", "expected a string"),
    ({"opportunistic": {"max_time": "1-0", "default_time": "2-0"}}, "slurm.partitions.opportunistic",
     "default_time '2-0' is longer than max_time '1-0'"),
    ({"guaranteed": {"allow_accounts": ["vision", "vision"]}}, "slurm.partitions.guaranteed.allow_accounts",
     "accounts listed twice: vision"),
    ({"guaranteed": {"allow_accounts": ["a b"]}}, "slurm.partitions.guaranteed.allow_accounts",
     "'a b' is not a Slurm account name"),
    ({"guaranteed": {"allow_qos": []}}, "slurm.partitions.guaranteed.allow_qos", "would let nobody in"),
    ({"guaranteed": {"allow_accounts": ["a"], "deny_accounts": ["b"]}}, "slurm.partitions.guaranteed",
     "exclude each other"),
    ({"guaranteed": {"default": True}, "opportunistic": {"default": True}}, "slurm.partitions",
     "Slurm has one default partition"),
    ({"opportunistic": {"slurm_params": "PreemptMode=OFF"}}, "slurm.partitions.opportunistic.slurm_params",
     "PreemptMode= is not for slurm_params"),
    ({"opportunistic": {"slurm_params": "MaxTime=60"}}, "slurm.partitions.opportunistic.slurm_params", "set max_time"),
    ({"opportunistic": {"max_nodes": 0}}, "slurm.partitions.opportunistic.max_nodes", "greater than or equal to 1"),
    ({"opportunistic": {"walltime": "1-0"}}, "slurm.partitions.opportunistic.walltime", "unknown field"),
    ({"opportunistic": {"default": "yes"}}, "slurm.partitions.opportunistic.default", ""),
])
def test_bad_partition_options_are_named(partitions, where, words):
    with pytest.raises(config.ConfigError) as e:
        config.parse({"slurm": {"partitions": partitions}, "nodes": [{"name": "n1", "gpus": 1}]})
    problems = dict(e.value.problems)
    assert where in problems, e.value.problems
    assert words in problems[where], problems[where]


def test_opportunistic_qos_must_be_allowed_on_its_partition():
    with pytest.raises(config.ConfigError) as e:
        config.parse({"slurm": {"opportunistic_qos": "scavenger", "partitions": {"opportunistic": {
            "allow_qos": ["normal"]}}}, "nodes": [{"name": "n1", "gpus": 1}]})
    assert "opportunistic_qos 'scavenger' is not in partitions.opportunistic.allow_qos (normal)" in str(e.value)


def test_gpu_type_reaches_node_lines_gres_conf_and_settings():
    cfg = config.parse({"nodes": [{"name": "h[1-2]", "gpus": 8, "gpu_type": "h100"},
                                  {"name": "a1", "gpus": 4, "gpu_type": "a100"}, {"name": "old1", "gpus": 2}]})
    files = render_all(cfg)
    frag, gres, settings = files["antman.slurm.conf"], files["gres.conf"], files["antman_settings.lua"]
    # The default slots_per_gpu, 3 opportunistic slots per GPU.
    assert re.search(r"^NodeName=h1 .*Gres=gpu:h100:8,antman_opp:h100:24 ", frag, re.M)
    assert re.search(r"^NodeName=a1 .*Gres=gpu:a100:4,antman_opp:a100:12 ", frag, re.M)
    assert re.search(r"^NodeName=old1 .*Gres=gpu:2,antman_opp:6 ", frag, re.M)
    assert "NodeName=h[1-2] Name=gpu Type=h100 File=/dev/nvidia[0-7]" in gres
    assert "NodeName=h[1-2] Name=antman_opp Type=h100 Count=24" in gres
    assert "NodeName=old1 Name=antman_opp Count=6" in gres
    assert 'gpu_types = { ["a100"] = 4, ["h100"] = 8, },' in settings
    with pytest.raises(config.ConfigError) as e:
        config.parse({"nodes": [{"name": "n1", "gpus": 1, "gpu_type": "h100:80g"}]})
    assert "nodes.0.gpu_type" in str(e.value)


def test_gres_plugstack_and_settings(cfg):
    files = render_all(cfg)
    gres = files["gres.conf"]
    assert "NodeName=a[1-2] Name=gpu File=/dev/nvidia[0-7]" in gres
    assert "NodeName=a[1-2] Name=antman_opp Count=24" in gres
    assert "NodeName=b1 Name=gpu File=/dev/nv[0-1]" in gres
    # No absolute hook_dir: the plugin gets no prolog= (it would refuse a relative one) and says why.
    plug = files["plugstack.conf.d/antman.conf"].splitlines()
    assert plug[-1] == ("required /opt/antman/antman_spank.so state_dir=/var/lib/antman opp_partition=opportunistic "
                        "agent_path=/opt/slurm-antman/agent")
    assert plug[-2].startswith("# no prolog=: hook_dir '.'")


def test_plugstack_names_the_prolog_for_restarts(cfg):
    files = render_all(cfg, RenderOptions(hook_dir="/usr/libexec/antman"))
    assert files["plugstack.conf.d/antman.conf"].splitlines()[-1] == (
        "required /opt/antman/antman_spank.so state_dir=/var/lib/antman "
        "prolog=/usr/libexec/antman/antman-prolog opp_partition=opportunistic agent_path=/opt/slurm-antman/agent")
    # The same hook slurm.conf must name as the Prolog.
    assert "Prolog=/usr/libexec/antman/antman-prolog" in files["slurm.conf.needed"].splitlines()
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
    assert names == {"antman.slurm.conf", "slurm.conf.needed", "gres.conf", "plugstack.conf.d/antman.conf",
                     "antman_settings.lua", "antman-prolog", "antman-epilog"}
    assert os.access(out / "antman-prolog", os.X_OK)
    slurm_conf = tmp_path / "slurm.conf"
    # A site without any of the site-wide keys: slurm.conf.needed's lines are what it adds.
    slurm_conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        + (out / "slurm.conf.needed").read_text() + f"Include {out}/antman.slurm.conf\n")
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


def test_hooks_find_a_prefix_installed_slurm(tmp_path):
    """slurmd runs the Prolog without a PATH; a Slurm built into a prefix (/opt/slurm/bin) must come first on
    the hooks' own, or their scontrol is the system's (another release, or none)."""
    from slurm_antman.admin.render import hook_script
    from slurm_antman.slurm.version import commands_dir as slurm_bin_dir

    cfg = config.parse({"nodes": [{"name": "n1", "gpus": 1}]})
    text = hook_script(cfg, RenderOptions(slurm_bin="/opt/slurm 25/bin"), "prolog")
    assert "export PATH='/opt/slurm 25/bin':/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n" in text
    assert "export PATH" not in hook_script(cfg, RenderOptions(), "prolog")
    (tmp_path / "bin").mkdir()
    assert slurm_bin_dir(lambda name: str(tmp_path / "bin" / name)) == str(tmp_path / "bin")
    assert slurm_bin_dir(lambda name: "/usr/bin/scontrol") is None
    assert slurm_bin_dir(lambda name: None) is None
