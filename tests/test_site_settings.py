"""The site-wide slurm.conf settings slurm-antman needs (slurm_antman.admin.site_settings): judged by membership on
the running Slurm's values, merged into a site's slurm.conf keeping what the site has, conflicts refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_antman import config
from slurm_antman.admin import site_settings as ss

CFG = config.parse({"nodes": [{"name": "n1", "gpus": 1}]})
HOOKS = "/etc/slurm-antman/rendered"
NEEDS = ss.needs(CFG, HOOKS)
BY_KEY = {n.key: n for n in NEEDS}
PROLOG, EPILOG = f"{HOOKS}/antman-prolog", f"{HOOKS}/antman-epilog"

# What `scontrol show config` says on a site that has everything slurm-antman needs, in its own words.
GOOD = {
    "GresTypes": "gpu,antman_opp,nic", "PreemptType": "preempt/partition_prio", "PreemptMode": "GANG,REQUEUE",
    "SlurmctldParameters": "enable_configless,preempt_send_user_signal,max_dbd_msg_action=discard",
    "JobSubmitPlugins": "job_submit/require_timelimit,lua", "CliFilterPlugins": "cli_filter/lua",
    "PrologFlags": "Alloc,Contain", "Prolog": PROLOG, "Epilog": EPILOG,
    "AccountingStorageType": "accounting_storage/slurmdbd",
    "AccountingStorageTRES": "cpu,mem,energy,node,billing,fs/disk,vmem,pages,gres/gpu,gres/antman_opp",
}


def texts(ps: list[ss.Problem]) -> dict[str, str]:
    return {p.key: p.text for p in ps}


def test_a_site_with_everything_has_no_problem():
    assert ss.problems(NEEDS, GOOD) == []


@pytest.mark.parametrize("key, value, text", [
    ("SlurmctldParameters", "enable_configless",
     "SlurmctldParameters=enable_configless lacks preempt_send_user_signal: add it to the list"),
    ("SlurmctldParameters", "(null)", "SlurmctldParameters is not set: set SlurmctldParameters=preempt_send_user_signal"),
    ("GresTypes", "gpu", "GresTypes=gpu lacks antman_opp: add it to the list"),
    ("GresTypes", "nic", "GresTypes=nic lacks gpu and antman_opp: add them to the list"),
    ("JobSubmitPlugins", "job_submit/all_partitions", "JobSubmitPlugins=job_submit/all_partitions lacks lua"),
    ("CliFilterPlugins", "(null)", "CliFilterPlugins is not set: set CliFilterPlugins=cli_filter/lua"),
    ("PrologFlags", "Serial", "PrologFlags=Serial lacks Alloc: add it to the list"),
    ("AccountingStorageTRES", "cpu,mem,gres/gpu", "AccountingStorageTRES=cpu,mem,gres/gpu lacks gres/antman_opp"),
    ("PreemptType", "preempt/qos", "PreemptType=preempt/qos, slurm-antman needs preempt/partition_prio"),
    ("PreemptType", "preempt/none", "PreemptType=preempt/none: set PreemptType=preempt/partition_prio"),
    ("PreemptMode", "OFF", "PreemptMode=OFF (no mode but OFF): set a mode other than OFF, e.g. PreemptMode=OFF,REQUEUE"),
    ("PreemptMode", "GANG", "PreemptMode=GANG (no mode but OFF): set a mode other than OFF, e.g. PreemptMode=GANG,REQUEUE"),
    ("Prolog", "(null)", f"Prolog is not set: set Prolog={PROLOG}"),
])
def test_each_conflict_is_one_line_naming_key_value_and_need(key, value, text):
    ps = ss.problems(NEEDS, {**GOOD, key: value})
    assert len(ps) == 1 and ps[0].key == key, ps
    assert ps[0].text.startswith(text), ps[0].text


@pytest.mark.parametrize("key, value", [
    ("JobSubmitPlugins", "lua"), ("JobSubmitPlugins", "job_submit/lua"), ("CliFilterPlugins", "lua"),
    ("PrologFlags", "Contain"), ("PrologFlags", "x11"), ("PrologFlags", "alloc"),
    ("PreemptMode", "CANCEL"), ("PreemptMode", "SUSPEND,GANG"),  # the opportunistic partition sets REQUEUE itself
    ("SlurmctldParameters", "preempt_send_user_signal"),
])
def test_membership_not_equality(key, value):
    assert ss.problems(NEEDS, {**GOOD, key: value}) == []


def test_accounting_tres_is_judged_only_with_slurmdbd():
    conf = {**GOOD, "AccountingStorageType": "accounting_storage/none", "AccountingStorageTRES": "cpu,mem"}
    assert ss.problems(NEEDS, conf) == []


def test_a_site_prolog_that_calls_antmans_hook_is_fine(tmp_path):
    site = tmp_path / "prolog.sh"
    site.write_text(f"#!/bin/sh\n/usr/local/sbin/site-prolog || exit 1\nexec {PROLOG}\n")
    other = tmp_path / "other.sh"
    other.write_text("#!/bin/sh\nexit 0\n")
    assert ss.problems(NEEDS, {**GOOD, "Prolog": str(site)}) == []
    # The rendered hook itself, wherever it is (doctor does not know --hook-dir): `antman ... node prolog`.
    rendered = tmp_path / "hook"
    rendered.write_text("#!/bin/sh\nexec /usr/bin/antman node prolog --config /etc/a.yaml\n")
    epilog = tmp_path / "hook-e"
    epilog.write_text("#!/bin/sh\nexec /usr/bin/antman node epilog --config /etc/a.yaml\n")
    assert ss.problems(ss.needs(CFG), {**GOOD, "Prolog": str(rendered), "Epilog": str(epilog)}) == []
    ps = texts(ss.problems(ss.needs(CFG), {**GOOD, "Prolog": str(epilog), "Epilog": str(epilog)}))
    assert list(ps) == ["Prolog"]  # an epilog hook is no prolog hook
    # 24.11 runs several: one of them is enough.
    assert ss.problems(NEEDS, {**GOOD, "Prolog": f"{other},{site}"}) == []
    ps = texts(ss.problems(NEEDS, {**GOOD, "Prolog": str(other)}))
    assert ps["Prolog"] == (f"Prolog={other} does not run {PROLOG}: call it from your Prolog (keeping its exit "
                            "status), or add it as another Prolog= line on Slurm 24.11")
    ps = texts(ss.problems(NEEDS, {**GOOD, "Epilog": str(tmp_path / "missing")}))
    assert "cannot read" in ps["Epilog"] and "run antman doctor on a node" in ps["Epilog"]


# --- merge ----------------------------------------------------------------------------------

SITE = """# our cluster
ClusterName=site
SlurmctldParameters=enable_configless   # served to the login nodes
GresTypes=gpu
PreemptType=preempt/none
PartitionName=cpu Nodes=c[1-4] PreemptMode=OFF Default=YES
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageTRES=gres/gpu
Include {inc}
"""


def test_merge_appends_to_lists_keeps_the_sites_values_and_comments(tmp_path):
    inc = tmp_path / "prolog.conf"
    inc.write_text("PrologFlags=Contain\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text(SITE.format(inc=inc))
    os.chmod(conf, 0o640)
    res = ss.merge_file(conf, NEEDS)
    assert res.conflicts == []
    text = conf.read_text()
    lines = text.splitlines()
    assert "SlurmctldParameters=enable_configless,preempt_send_user_signal   # served to the login nodes" in lines
    assert "GresTypes=gpu,antman_opp" in lines and "AccountingStorageTRES=gres/gpu,gres/antman_opp" in lines
    assert "PreemptType=preempt/partition_prio" in lines
    assert "PartitionName=cpu Nodes=c[1-4] PreemptMode=OFF Default=YES" in lines  # a partition's own key: untouched
    for added in ("PreemptMode=REQUEUE", "JobSubmitPlugins=lua", "CliFilterPlugins=cli_filter/lua",
                  f"Prolog={PROLOG}", f"Epilog={EPILOG}"):
        assert lines.count(added) == 1, added
    assert "PrologFlags" not in text  # Contain (in the Included file) implies Alloc
    assert inc.read_text() == "PrologFlags=Contain\n"
    # The original is kept, the mode too, and every change was said.
    assert res.backups and res.backups[0].read_text() == SITE.format(inc=inc)
    assert oct(conf.stat().st_mode & 0o777) == "0o640"
    assert "SlurmctldParameters: enable_configless -> enable_configless,preempt_send_user_signal (slurm.conf line 3)" \
        in res.changes
    assert any("partitions that must never be preempted" in n for n in res.notes)
    # Merged once, a second merge changes nothing and writes nothing.
    again = ss.merge_file(conf, NEEDS)
    assert again.changes == [] and again.written == [] and conf.read_text() == text


def test_merge_edits_a_key_where_slurm_reads_it(tmp_path):
    inc = tmp_path / "site.conf"
    inc.write_text("SlurmctldParameters=enable_configless\nSlurmctldParameters=idle_on_node_suspend\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=x\nInclude {inc.name}\n")
    res = ss.merge_file(conf, [BY_KEY["SlurmctldParameters"]])
    assert inc.read_text().splitlines() == ["SlurmctldParameters=enable_configless",
                                            "SlurmctldParameters=idle_on_node_suspend,preempt_send_user_signal"]
    assert conf.read_text() == f"ClusterName=x\nInclude {inc.name}\n"
    assert res.written == [inc]


def test_merge_refuses_a_conflict_and_writes_nothing(tmp_path):
    conf = tmp_path / "slurm.conf"
    original = "PreemptType=preempt/qos\nPrologFlags=Serial\nProlog=/etc/slurm/prolog.sh\n"
    conf.write_text(original)
    res = ss.merge_file(conf, NEEDS, many_prologs=False)
    assert conf.read_text() == original and res.written == [] and res.backups == []
    assert len(res.conflicts) == 2
    assert res.conflicts[0].startswith("PreemptType=preempt/qos (slurm.conf line 1), slurm-antman needs "
                                       "preempt/partition_prio")
    assert res.conflicts[1].startswith(f"Prolog=/etc/slurm/prolog.sh (slurm.conf line 3) does not run {PROLOG}, "
                                       "and this Slurm runs one Prolog")


def test_merge_adds_a_prolog_line_where_slurm_runs_several(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("Prolog=/etc/slurm/prolog.sh\n")
    res = ss.merge_file(conf, [BY_KEY["Prolog"]], many_prologs=True)
    assert res.conflicts == []
    lines = conf.read_text().splitlines()
    assert lines[0] == "Prolog=/etc/slurm/prolog.sh" and lines[-1] == f"Prolog={PROLOG}"


def test_merge_text_is_what_the_devcluster_uses():
    res = ss.merge_text("GresTypes=gpu\nPreemptMode=OFF\n", ss.needs(CFG, HOOKS, with_antman=False))
    assert res.text.splitlines()[:2] == ["GresTypes=gpu,antman_opp", "PreemptMode=REQUEUE"]
    assert "PreemptType=preempt/partition_prio" in res.text.splitlines()
    assert "JobSubmitPlugins" not in res.text  # a cluster without the slurm-antman stack


def test_merge_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(ss.MergeError, match="cannot read .*nope"):
        ss.merge_file(tmp_path / "nope", NEEDS)


def _cli(*args: str, env: dict | None = None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "slurm_antman.cli", "config", "merge-slurm-conf", *args],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, timeout=60,
                          env=env)


def test_merge_command_prints_changes_backs_up_and_refuses_conflicts(tmp_path):
    root = Path(__file__).resolve().parent.parent
    conf = tmp_path / "slurm.conf"
    conf.write_text("SlurmctldParameters=enable_configless\n")
    yaml_path = str(root / "etc" / "antman.yaml")
    r = _cli(yaml_path, "--slurm-conf", str(conf), "--hook-dir", HOOKS, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "SlurmctldParameters: enable_configless -> enable_configless,preempt_send_user_signal" in r.stdout
    assert "not changed (--dry-run)" in r.stdout and conf.read_text() == "SlurmctldParameters=enable_configless\n"
    r = _cli(yaml_path, "--slurm-conf", str(conf), "--hook-dir", HOOKS)
    assert r.returncode == 0, r.stderr
    assert "preempt_send_user_signal" in conf.read_text() and "merged (the original is" in r.stdout
    assert len(list(tmp_path.glob("slurm.conf.before-antman-*"))) == 1
    r = _cli(yaml_path, "--slurm-conf", str(conf), "--hook-dir", HOOKS)
    assert r.returncode == 0 and "already has every setting slurm-antman needs" in r.stdout
    conf.write_text("PreemptType=preempt/qos\n")
    r = _cli(yaml_path, "--slurm-conf", str(conf), "--hook-dir", HOOKS)
    assert r.returncode == 1 and r.stdout.startswith("CONFLICT PreemptType=preempt/qos (slurm.conf line 1)")
    assert conf.read_text() == "PreemptType=preempt/qos\n"
    r = _cli(yaml_path, "--slurm-conf", str(conf))
    assert r.returncode == 2 and "give --hook-dir" in r.stderr
