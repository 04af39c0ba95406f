"""`antman devcluster status` lists each node once, and the demo and `antman devcluster` share one
cluster directory (the cluster `make demo DEMO_ARGS=--keep` leaves is the one `antman devcluster up`
finds). Without a cluster; tests/test_devcluster.py runs the same on a real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from slurm_antman.lab.devcluster import cluster as dc

REPO = Path(__file__).resolve().parent.parent

# `sinfo -h -N -o '%N|%T|%G|%P'` on a 2-node devcluster, as Slurm 22.05 printed it (a line per node and
# partition; the order of a node's partitions changes from call to call).
SINFO = """node1|idle|gpu:2,antman_opp:4|gpu*
node1|idle|gpu:2,antman_opp:4|opportunistic
node2|mixed|gpu:2,antman_opp:4|opportunistic
node2|mixed|gpu:2,antman_opp:4|gpu*
"""


def test_status_lists_each_node_once():
    assert dc.node_lines(SINFO) == ["node1 idle gpu:2,antman_opp:4 (partitions gpu*,opportunistic)",
                                    "node2 mixed gpu:2,antman_opp:4 (partitions gpu*,opportunistic)"]
    assert dc.node_lines("") == []


def _defaults(env: dict) -> dict:
    code = ("import json; from slurm_antman import cli; p = cli.build_parser();"
            "print(json.dumps({c: vars(p.parse_args([c, *a]))['dir'] for c, a in "
            "(('devcluster', ['status']), ('demo', []))}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=True)
    return json.loads(r.stdout)


def test_demo_and_devcluster_default_to_one_directory():
    env = {k: v for k, v in os.environ.items() if k != "ANTMAN_DEVCLUSTER_DIR"}
    assert _defaults(env) == {"devcluster": "/tmp/antman-devcluster", "demo": "/tmp/antman-devcluster"}
    assert str(dc.DEFAULT_DIR) == os.environ.get("ANTMAN_DEVCLUSTER_DIR", "/tmp/antman-devcluster")
    moved = _defaults({**env, "ANTMAN_DEVCLUSTER_DIR": "/srv/dc"})
    assert moved == {"devcluster": "/srv/dc", "demo": "/srv/dc"}


def test_shape_differences_name_what_differs(tmp_path):
    # What `up` writes down when it starts a cluster, and how a later `up` is compared with it.
    (tmp_path / "up.json").write_text(json.dumps(
        {"nodes": 1, "gpus": 1, "port_base": 17917, "overrides": {"grace_time_s": 5}, "installed": None}))
    assert dc.shape_differences(tmp_path, {"nodes": 1, "overrides": {"grace_time_s": 5}}) == []
    assert dc.shape_differences(tmp_path, {"nodes": 2, "gpus": 1, "installed": None, "overrides": {}}) == [
        "nodes: running 1, asked 2", "overrides: running {'grace_time_s': 5}, asked {}"]
    assert dc.shape_differences(tmp_path / "none", {"nodes": 2}) == []  # started before up.json existed
