"""``antman doctor``: on the real devcluster every check passes (NVML only warns without a GPU);
each thing broken on purpose turns its check to fail with a message that names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurm_antman import config as cfgmod
from slurm_antman.admin import doctor
from slurm_antman.slurm import version as slurm_version

REPO = Path(__file__).resolve().parent.parent


def run_doctor(env: dict, *args: str) -> tuple[int, dict[str, dict]]:
    r = subprocess.run([sys.executable, "-m", "slurm_antman.admin.doctor", "--json", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)}


@pytest.mark.cluster
def test_devcluster_is_healthy(cluster):
    rc, checks = run_doctor(cluster.env, "--node", "node1")
    not_ok = {n: c for n, c in checks.items() if c["status"] != "ok" and n != "nvml"}
    assert not not_ok, not_ok
    assert rc == 0
    assert checks["nvml"]["status"] in ("ok", "warn")  # no GPU here: a warning, never a failure
    have = slurm_version.installed_version(cluster.env)  # 22.05 on the host, 24.11 in make test-slurm24
    assert f"Slurm {slurm_version.fmt(have)}" in checks["slurm_version"]["reason"]


@pytest.mark.cluster
def test_broken_config_is_named(cluster, tmp_path):
    raw = yaml.safe_load(Path(cluster.env["ANTMAN_CONFIG"]).read_text())
    raw["plugin_path"] = str(tmp_path / "nowhere" / "antman_spank.so")
    raw["sidecar"]["socket_dir"] = str(tmp_path / "sockets")
    (tmp_path / "sockets").mkdir(mode=0o777)
    os.chmod(tmp_path / "sockets", 0o777)  # umask-proof
    broken = tmp_path / "antman.yaml"
    broken.write_text(yaml.safe_dump(raw))
    env = {**cluster.env, "ANTMAN_CONFIG": str(broken)}
    rc, checks = run_doctor(env, "--node", "node1")
    assert rc == 1
    assert checks["spank_plugin"]["status"] == "fail"
    assert f"plugin_path {raw['plugin_path']} does not exist" in checks["spank_plugin"]["reason"]
    assert "make -C spank install" in checks["spank_plugin"]["hint"]
    assert checks["plugstack"]["status"] == "fail" and "does not list" in checks["plugstack"]["reason"]
    assert checks["sidecar"]["status"] == "fail" and "no sidecar answers" in checks["sidecar"]["reason"]
    assert checks["socket_dir"]["status"] == "fail" and "world-writable" in checks["socket_dir"]["reason"]
    # What was not broken still passes: the checks are independent.
    assert checks["sbatch_option"]["status"] == "ok" and checks["job_submit"]["status"] == "ok"


@pytest.mark.cluster
def test_text_output_and_invalid_config(cluster, tmp_path):
    bad = tmp_path / "antman.yaml"
    bad.write_text("nodes: []\n")
    r = subprocess.run([sys.executable, "-m", "slurm_antman.admin.doctor", "--config", str(bad), "--node", "node1"],
                       cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "FAIL  config" in r.stdout and "nodes:" in r.stdout
    assert "SKIP  spank_plugin" in r.stdout and "antman.yaml is not valid" in r.stdout
    assert "OK    sbatch_option" in r.stdout


# --- single checks, no cluster --------------------------------------------------------------

def _cfg(tmp_path: Path, **over) -> cfgmod.AntmanConfig:
    return cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "plugin_path": str(tmp_path / "p.so"), **over})


def test_plugstack_follows_includes(tmp_path):
    (tmp_path / "plugstack.conf.d").mkdir()
    (tmp_path / "plugstack.conf").write_text(f"# site plugins\ninclude {tmp_path}/plugstack.conf.d/*.conf\n")
    (tmp_path / "plugstack.conf.d" / "other.conf").write_text("optional /usr/lib/other.so\n")
    cfg = _cfg(tmp_path)
    sconf = {"PlugStackConfig": str(tmp_path / "plugstack.conf")}
    c = doctor.check_plugstack(cfg, sconf)
    assert c.status == "fail" and f"does not list {tmp_path}/p.so" in c.reason
    (tmp_path / "plugstack.conf.d" / "antman.conf").write_text(f"required {tmp_path}/p.so state_dir=/x\n")
    c = doctor.check_plugstack(cfg, sconf)
    assert c.status == "ok" and "antman.conf" in c.reason
    # A commented-out line does not count.
    (tmp_path / "plugstack.conf.d" / "antman.conf").write_text(f"# required {tmp_path}/p.so\n")
    assert doctor.check_plugstack(cfg, sconf).status == "fail"


def test_socket_dir_permissions(tmp_path):
    d = tmp_path / "run"
    assert doctor.check_socket_dir(_cfg(tmp_path, sidecar={"socket_dir": str(d)})).status == "warn"
    d.mkdir()
    os.chmod(d, 0o755)
    assert doctor.check_socket_dir(_cfg(tmp_path, sidecar={"socket_dir": str(d)})).status == "ok"
    os.chmod(d, 0o1777)
    c = doctor.check_socket_dir(_cfg(tmp_path, sidecar={"socket_dir": str(d)}))
    assert c.status == "fail" and "1777" in c.reason and "chmod 755" in c.hint
    os.chmod(d, 0o755)
    os.chown(d, 65534, -1)
    c = doctor.check_socket_dir(_cfg(tmp_path, sidecar={"socket_dir": str(d)}))
    assert c.status == "fail" and "uid 65534" in c.reason


def test_clock_skew_thresholds():
    import time

    assert doctor.check_clock(lambda: (float(int(time.time())), "")).status == "ok"
    c = doctor.check_clock(lambda: (time.time() + 10, ""))
    assert c.status == "warn" and "+10 s" in c.reason
    c = doctor.check_clock(lambda: (time.time() - 600, ""))
    assert c.status == "fail" and "-600 s" in c.reason and "chrony" in c.hint
    assert doctor.check_clock(lambda: (None, "sdiag: command not found")).status == "warn"


def test_plugin_version_is_read_from_the_built_plugin():
    so = REPO / "spank" / "antman_spank.so"
    r = subprocess.run(["make", "-s", "-C", str(REPO / "spank")], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"the SPANK plugin does not build here (libslurm-dev missing?): {r.stderr.strip()[:200]}")
    major, minor, _ = doctor.plugin_slurm_version(str(so))
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "slurm-wlm"], capture_output=True, text=True)
    if out.returncode == 0:
        assert out.stdout.startswith(f"{major}.{minor:02d}.")
    else:
        assert (major, minor) >= (20, 0)


def test_enforcement_says_what_is_in_force_and_what_is_not():
    check_enforcement = doctor.check_enforcement
    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "sidecar": {"telemetry": "nvml"}})
    c = check_enforcement(cfg, {"ProctrackType": "proctrack/cgroup"}, caps=lambda: "")
    assert c.status == "ok" and "found through NVML and Slurm's cgroups" in c.reason
    assert "after 120 s" in c.reason and "driver memory caps (MPS v3 memory partitioning) set by the sidecar" in c.reason
    c = check_enforcement(cfg, {"ProctrackType": "proctrack/linuxproc"}, caps=lambda: "no NVML (x)")
    assert "cannot be mapped to jobs (ProctrackType=proctrack/linuxproc" in c.reason
    assert "no driver memory caps (no NVML (x))" in c.reason
    observe = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "sidecar": {"enforce": False}})
    assert check_enforcement(observe, {}).status == "warn"


def _assoc_reader(rows=None, error=None):
    from slurm_antman.slurm.errors import SlurmUnavailable
    from slurm_antman.slurm.parsing import associations_from_sacctmgr

    def read(cluster):
        if error:
            raise SlurmUnavailable(error)
        return associations_from_sacctmgr(rows)
    return read


DBD = {"AccountingStorageType": "accounting_storage/slurmdbd",
       "AccountingStorageTRES": "cpu,mem,energy,node,billing,fs/disk,vmem,pages,gres/gpu,gres/antman_opp"}


def test_quotas_name_the_source_in_force_and_where_accounting_disagrees():
    base = {"cluster_name": "c1", "nodes": [{"name": "n1", "gpus": 1}]}
    cfg = cfgmod.parse({**base, "tenants": [{"account": "vision", "guaranteed_gpus": 2},
                                            {"account": "nlp", "guaranteed_gpus": 1}]})
    rows = "c1|vision||root|gres/gpu=2\nc1|nlp||root|gres/gpu=3\n"
    c = doctor.check_quotas(cfg, DBD, _assoc_reader(rows))
    assert c.status == "warn"
    assert c.reason.startswith("Slurm accounting (GrpTRES=gres/gpu on 2 account(s): nlp=3, vision=2)")
    assert "tenant nlp: antman.yaml says 1 GPUs, accounting GrpTRES gres/gpu=3" in c.reason
    # agreeing sources, no antman.yaml tenants at all: plain ok
    c = doctor.check_quotas(cfgmod.parse(base), DBD, _assoc_reader(rows))
    assert c.status == "ok" and "nlp=3, vision=2" in c.reason
    # the override is named as such
    over = cfgmod.parse({**base, "tenants": [{"account": "vision", "guaranteed_gpus": 2}],
                         "coordinator": {"quota_source": "antman_yaml"}})
    c = doctor.check_quotas(over, DBD, _assoc_reader("c1|vision||root|gres/gpu=2\n"))
    assert c.status == "ok" and "quota_source: antman_yaml overrides accounting" in c.reason
    # a typed GPU limit is not a count: named with its account
    c = doctor.check_quotas(cfgmod.parse(base), DBD, _assoc_reader("c1|cv||root|gres/gpu:a100=4\n"))
    assert c.status == "warn" and "account cv: GrpTRES gres/gpu:a100=4 is a typed GPU limit" in c.reason


def test_quotas_without_accounting_or_when_it_does_not_answer():
    base = {"cluster_name": "c1", "nodes": [{"name": "n1", "gpus": 1}]}
    none = {"AccountingStorageType": "accounting_storage/none"}
    c = doctor.check_quotas(cfgmod.parse(base), none, _assoc_reader(error="unused"))
    assert c.status == "ok" and c.reason.startswith("antman.yaml tenants (0): Slurm has no accounting storage")
    demanded = cfgmod.parse({**base, "coordinator": {"quota_source": "accounting"}})
    c = doctor.check_quotas(demanded, none, _assoc_reader(error="unused"))
    assert c.status == "fail" and "AccountingStorageType=accounting_storage/slurmdbd" in c.hint
    c = doctor.check_quotas(cfgmod.parse(base), DBD, _assoc_reader(error="Connection refused"))
    assert c.status == "warn" and "cannot read accounting: Connection refused" in c.reason


def test_quotas_warn_when_accounting_does_not_track_the_gpu_tres():
    cfg = cfgmod.parse({"cluster_name": "c1", "nodes": [{"name": "n1", "gpus": 1}]})
    untracked = {**DBD, "AccountingStorageTRES": "cpu,mem,energy,node,billing,fs/disk,vmem,pages"}
    c = doctor.check_quotas(cfg, untracked, _assoc_reader("c1|vision||root|\n"))
    assert c.status == "warn" and "does not track gres/gpu" in c.reason and "AccountingStorageTRES" in c.hint


def test_quota_file_unset_with_tenants_fails_saying_what_to_add(tmp_path):
    cfg = _cfg(tmp_path, tenants=[{"account": "vision", "guaranteed_gpus": 4}])
    c = doctor.check_quota_file(cfg, {"SLURM_CONF": "/etc/slurm-llnl/slurm.conf"})
    assert c.status == "fail"
    assert "1 tenant(s) in antman.yaml but coordinator.quota_file is unset" in c.reason
    assert "quota_file: /etc/slurm-llnl/antman_quota.lua" in c.hint and "coordinator:" in c.hint
    # quotas from accounting need the file as much
    c = doctor.check_quota_file(_cfg(tmp_path, coordinator={"quota_source": "accounting"}), None)
    assert c.status == "fail" and "quota_source is accounting" in c.reason
    assert "quota_file: /etc/slurm/antman_quota.lua" in c.hint
    # no tenants anywhere: auto has no quota to follow
    assert doctor.check_quota_file(_cfg(tmp_path), None).status == "ok"


def test_quota_file_where_job_submit_reads_it(tmp_path):
    tenants = [{"account": "vision", "guaranteed_gpus": 4}]
    sconf = {"SLURM_CONF": str(tmp_path / "slurm.conf")}
    good = _cfg(tmp_path, tenants=tenants, coordinator={"quota_file": str(tmp_path / "antman_quota.lua")})
    c = doctor.check_quota_file(good, sconf)
    assert c.status == "ok" and str(tmp_path / "antman_quota.lua") in c.reason
    c = doctor.check_quota_file(_cfg(tmp_path, tenants=tenants, coordinator={"quota_file": str(tmp_path / "q.lua")}),
                                sconf)
    assert c.status == "fail" and "reads only antman_quota.lua" in c.reason
    elsewhere = _cfg(tmp_path, tenants=tenants, coordinator={"quota_file": "/var/lib/antman/antman_quota.lua"})
    c = doctor.check_quota_file(elsewhere, sconf)
    assert c.status == "warn" and "not next to slurm.conf" in c.reason and str(tmp_path / "antman_quota.lua") in c.hint


def test_example_config_sets_the_quota_file():
    cfg = cfgmod.load(str(REPO / "etc" / "antman.yaml"))
    assert cfg.tenants and doctor.check_quota_file(cfg, {"SLURM_CONF": "/etc/slurm/slurm.conf"}).status == "ok"


def test_quota_file_unset_with_accounting_in_force_warns(tmp_path):
    c = doctor.check_quota_file(_cfg(tmp_path), {"AccountingStorageType": "accounting_storage/slurmdbd"})
    assert c.status == "warn" and "GrpTRES" in c.reason and "quota_file: /etc/slurm/antman_quota.lua" in c.hint


# --- the site-wide slurm.conf settings (merge, never overwrite) -------------------------------

def _good_conf(tmp_path: Path) -> dict[str, str]:
    hooks = {}
    for hook in ("prolog", "epilog"):
        f = tmp_path / f"antman-{hook}"
        f.write_text(f"#!/bin/sh\nexec antman node {hook} --config /etc/antman.yaml\n")
        f.chmod(0o755)
        hooks[hook] = str(f)
    return {"SLURM_CONF": str(tmp_path / "slurm.conf"), "GresTypes": "gpu,antman_opp",
            "PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE",
            "SlurmctldParameters": "enable_configless,preempt_send_user_signal", "JobSubmitPlugins": "lua",
            "CliFilterPlugins": "cli_filter/lua", "PrologFlags": "Alloc,Contain", "Prolog": hooks["prolog"],
            "Epilog": hooks["epilog"], "AccountingStorageType": "accounting_storage/slurmdbd",
            "AccountingStorageTRES": "cpu,mem,gres/gpu,gres/antman_opp"}


def test_slurm_conf_one_fail_line_per_conflict(tmp_path):
    cfg = _cfg(tmp_path)
    good = _good_conf(tmp_path)
    assert [c.status for c in doctor.check_slurm_conf(cfg, good)] == ["ok"]
    bad = {**good, "SlurmctldParameters": "enable_configless", "PreemptType": "preempt/qos",
           "AccountingStorageTRES": "cpu,mem,gres/gpu"}
    checks = doctor.check_slurm_conf(cfg, bad)
    assert [c.status for c in checks] == ["fail"] * 3
    text = doctor.render_text(checks)
    assert "FAIL  slurm_conf  SlurmctldParameters=enable_configless lacks preempt_send_user_signal: add it to the " \
           "list\n" in text
    assert "FAIL  slurm_conf  PreemptType=preempt/qos, slurm-antman needs preempt/partition_prio" in text
    assert "FAIL  slurm_conf  AccountingStorageTRES=cpu,mem,gres/gpu lacks gres/antman_opp: add it to the list" in text
    assert "antman config merge-slurm-conf" in checks[0].hint


def test_slurm_config_goes_through_the_adapter_and_names_its_failure():
    from slurm_antman.slurm.errors import SlurmUnavailable

    def down():
        raise SlurmUnavailable("Slurm controller unavailable: Unable to contact slurm controller", ["scontrol"])

    conf, c = doctor.slurm_config(read=down)
    assert conf is None and c.status == "fail"
    assert c.reason == "scontrol show config failed: Slurm controller unavailable: Unable to contact slurm controller"
    conf, c = doctor.slurm_config(read=lambda: {"SLURM_VERSION": "22.05.8", "SLURM_CONF": "/etc/slurm/slurm.conf"})
    assert c.status == "ok" and "Slurm 22.05.8" in c.reason


def test_job_submit_must_load_the_module(tmp_path):
    conf = {"SLURM_CONF": str(tmp_path / "slurm.conf")}
    for name in doctor.JOB_SUBMIT_FILES:
        (tmp_path / name).write_text("-- x\n")
    (tmp_path / "job_submit.lua").write_text("-- the site's own; antman_job_submit.lua mentioned in a comment only\n"
                                             "function slurm_job_submit() return 0 end\n")
    c = doctor.check_job_submit(conf)
    assert c.status == "fail" and "does not load antman_job_submit.lua" in c.reason
    assert doctor.CHAIN_LINE in c.hint
    (tmp_path / "job_submit.lua").write_text((REPO / "etc" / "examples" / "job_submit.lua").read_text())
    assert doctor.check_job_submit(conf).status == "ok"
    (tmp_path / "antman_settings_loader.lua").unlink()
    c = doctor.check_job_submit(conf)
    assert c.status == "fail" and "antman_settings_loader.lua" in c.reason
