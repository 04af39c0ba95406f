"""A site with a job_submit.lua and a cli_filter.lua of its own, and GPUs of two types, on a real cluster.

The devcluster installs etc/examples/job_submit.lua and cli_filter.lua (the site's own rules, plus the one
line each that calls slurm-antman's module) instead of the plain scripts, and declares two typed node
groups (node1: h100, node2: a100; antman.yaml nodes[].gpu_type). A representative subset of the
submission tests runs here unchanged (imported from test_cluster_submission and test_site_cluster, on
this module's ``clean_cluster``), then the site's own rules and typed GPUs of both classes.
"""

from __future__ import annotations

import re

import pytest

from conftest import TEST_PORT_BASE, managed_cluster
from slurm_antman import config as config_mod
from slurm_antman.slurm.parsing import tres_body

# The submission tests, as they are, on the site-script cluster (pytest collects what the module holds).
# (Preemption and the Prolog's fault paths are left out: the site's scripts are done with a job once it is
# submitted, and those tests take most of a minute each.)
from test_cluster_submission import (  # noqa: F401
    test_guaranteed_keeps_physical_gpus, test_no_flag_is_plain_slurm, test_opportunistic_rewritten_and_sees_one_gpu,
    test_guaranteed_cannot_take_opportunistic_partition, test_wrong_value_rejected_and_no_job_created)
from test_site_cluster import (  # noqa: F401
    GPUS_PER_NODE, allowed, gpus, lines, probe, test_each_class_opens_exactly_its_own_gpus,
    test_srun_steps_with_gpus_in_a_batch_job, test_srun_with_antman_makes_its_own_allocation)

pytestmark = pytest.mark.cluster

PORT_BASE = TEST_PORT_BASE + 1300
TYPES = {"node1": "h100", "node2": "a100"}


def _groups(d) -> list[dict]:
    base = {"gpus": GPUS_PER_NODE, "cpus": 4, "memory_mb": 4000, "gpu_memory_mb": 16384,
            "gpu_files": str(d / "dev" / f"nvidia[0-{GPUS_PER_NODE - 1}]")}
    return [{**base, "name": node, "gpu_type": t} for node, t in TYPES.items()]


@pytest.fixture(scope="module")
def site_cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("site-scripts-cluster")
    # No accounting and no coordinator: nothing here needs them, and the machine running the tests is small.
    with managed_cluster(d, tmp_path_factory.mktemp("site-jobs"), nodes=2, gpus=GPUS_PER_NODE, cpus=4,
                         port_base=PORT_BASE, site_scripts=True, accounting=False, coordinator=False,
                         overrides={"nodes": _groups(d.resolve())}) as c:
        yield c


@pytest.fixture
def clean_cluster(site_cluster):
    site_cluster.cancel_all()
    site_cluster.wait_empty(30)
    return site_cluster


def test_the_cluster_runs_the_sites_scripts_with_antmans_line(site_cluster):
    etc = site_cluster.c.dir / "etc"
    for name in ("job_submit.lua", "cli_filter.lua"):
        text = (etc / name).read_text()
        assert "site policy" in text and f'"antman_{name}").chain()' in text
    conf = site_cluster.c.slurm_conf.read_text().splitlines()
    # The devcluster's own values, with slurm-antman's needs merged in, never replaced.
    assert "SlurmctldParameters=enable_configless,preempt_send_user_signal" in conf
    assert "GresTypes=gpu,antman_opp" in conf


def test_site_rules_run_first_then_antman(clean_cluster):
    c = clean_cluster
    jid = c.sbatch("--antman=opportunistic", "--gres=gpu:1", wrap="sleep 30")
    info = c.wait_state(jid, {"RUNNING"})
    assert info["TimeLimit"] == "1-00:00:00"  # the site's default for a job without --time
    assert info["Partition"] == "opportunistic" and tres_body(info["TresPerNode"]).startswith("antman_opp:")
    assert info["AdminComment"].startswith("antman:class=opportunistic")
    before = c.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    r = c.sbatch("--antman=guaranteed", "--gres=gpu:1", "--time=8-0", wrap="true", expect_ok=False)
    assert r.returncode != 0
    assert "site policy: a job may run at most 7 days (--time=7-0); this one asks for 11520 minutes" in r.stderr
    assert c.run(["squeue", "-h", "-o", "%i"]).stdout.split() == before
    # An update goes through the site's modify rule (it lets this one by), then antman's guard: the user's
    # pending opportunistic job may not move onto the guaranteed partition.
    held = c.sbatch("--antman=opportunistic", "--gres=gpu:1", "--hold", wrap="true")
    r = c.run_as_user(["scontrol", "update", f"JobId={held}", "Partition=gpu"])
    assert r.returncode != 0 and "Access/permission denied" in r.stderr, r.stderr
    assert c.show(held)["Partition"] == "opportunistic"
    log = (c.c.dir / "log" / "slurmctld.log").read_text()
    assert f"job {held} is opportunistic: it cannot be moved to the gpu partition" in log


def test_site_cli_filter_rule_then_antmans_rewrite(clean_cluster):
    c = clean_cluster
    r = c.run_as_user(["srun", "-O", "-n1", "true"], timeout=60, cwd=c.workdir)
    assert r.returncode != 0 and "site policy: --overcommit (-O) is not allowed on this cluster" in r.stderr


@pytest.mark.parametrize("cls", ["guaranteed", "opportunistic"])
def test_typed_gpus_of_each_class_run_on_a_node_of_their_type(clean_cluster, cls):
    c = clean_cluster
    script = "#!/bin/bash\n" + probe(c) + "sleep 30\n"
    for node, gpu_type in TYPES.items():
        jid = c.sbatch(f"--antman={cls}", f"--gres=gpu:{gpu_type}:2", script=script)
        info = c.wait_state(jid, {"RUNNING"}, timeout=60)
        assert info["NodeList"] == node, (gpu_type, info["NodeList"])
        want = f"gpu:{gpu_type}:2" if cls == "guaranteed" else f"antman_opp:{gpu_type}:2"
        assert tres_body(info["TresPerNode"]) == want
        s = lines(c.wait_output(jid, r"^PROBE ", timeout=60), "PROBE")[0]
        assert s["class"] == cls and s["node"] == node and len(gpus(s)) == 2 and allowed(s) == sorted(gpus(s)), s
    r = c.sbatch(f"--antman={cls}", "--gres=gpu:v100:1", wrap="true", expect_ok=False)
    assert r.returncode != 0
    if cls == "opportunistic":  # antman's own words; Slurm refuses the guaranteed one by itself
        assert "no GPU node of this cluster has type v100 (--gres=gpu:v100:1); the types are: a100, h100" in r.stderr


def test_the_coordinators_slot_update_keeps_a_typed_nodes_type(clean_cluster):
    """The coordinator shrinks a node's opportunistic slots at run time (scontrol update NodeName= Gres=):
    Slurm takes the typed form, and typed opportunistic jobs still find the node."""
    from slurm_antman.coordinator.executor import Executor
    from slurm_antman.policy.cluster import SetOppSlots
    from slurm_antman.slurm import CliBackend

    c = clean_cluster
    b = CliBackend(env=c.env)
    cfg = config_mod.load(c.c.config_path)
    full = GPUS_PER_NODE * cfg.opportunistic.slots_per_gpu
    try:
        out = Executor(b, cfg).execute(SetOppSlots("node1", 3), None)
        assert out.outcome == "ok", out
        node = next(n for n in b.nodes() if n.name == "node1")
        assert re.search(r"(^|,)antman_opp:h100:3(\(|,|$)", str(node.raw.get("gres"))), node.raw.get("gres")
        jid = c.sbatch("--antman=opportunistic", "--gres=gpu:h100:1", wrap="sleep 20")
        assert c.wait_state(jid, {"RUNNING"}, timeout=60)["NodeList"] == "node1"
    finally:
        assert Executor(b, cfg).execute(SetOppSlots("node1", full), None).outcome in ("ok", "skipped")
