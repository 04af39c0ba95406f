"""`antman doctor`'s device_control check: whether an opportunistic job's placed GPU can be granted on this node,
read from the node's mount table and cgroup.conf, and a recent grant failure (device_failure) shown to the admin."""

from __future__ import annotations

import pytest

from slurm_antman import config as cfgmod
from slurm_antman import device_failure
from slurm_antman.admin import doctor
from slurm_antman.slurm import cgroup_conf

# The mount tables of the three kinds of node (cgroup lines only; the rest of a real table does not matter).
V1 = """cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,nosuid,nodev,noexec,relatime,xattr,name=systemd 0 0
cgroup /sys/fs/cgroup/devices cgroup rw,nosuid,nodev,noexec,relatime,devices 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpu,cpuacct 0 0
"""
UNIFIED = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0\n"
HYBRID = """cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec,relatime 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,nosuid,nodev,noexec,relatime,xattr,name=systemd 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0
"""


@pytest.mark.parametrize("text, kind", [(V1, "v1"), (UNIFIED, "unified"), (HYBRID, "hybrid"),
                                        ("proc /proc proc rw 0 0\n", "none"),
                                        # a named hierarchy alone (systemd's) is no controller
                                        (UNIFIED + "cgroup /x cgroup rw,name=systemd 0 0\n", "unified")])
def test_the_hierarchy_is_read_from_the_mount_table(text, kind):
    assert cgroup_conf.hierarchy(text) == kind


def _node(tmp_path, mounts: str, cgroup: str | None):
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    if cgroup is not None:
        (tmp_path / "cgroup.conf").write_text(cgroup)
    (tmp_path / "mounts").write_text(mounts)
    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "state_dir": str(tmp_path / "state")})
    return cfg, dict(slurm_conf=str(tmp_path / "slurm.conf"), mounts=str(tmp_path / "mounts"))


@pytest.mark.parametrize("mounts, cgroup, status, says", [
    (V1, "CgroupPlugin=cgroup/v1\nConstrainDevices=yes\n", "ok", "cgroup v1: the plugin writes devices.allow"),
    (UNIFIED, "ConstrainDevices=yes\n", "ok", "amends the task cgroup's eBPF device program (CgroupPlugin=autodetect"),
    (UNIFIED, "CgroupPlugin=cgroup/v2\nConstrainDevices=yes\n", "ok", "eBPF"),
    (UNIFIED, "CgroupPlugin=cgroup/v1\nConstrainDevices=yes\n", "fail", "cgroup/v1 on a node that boots the unified"),
    (HYBRID, "CgroupPlugin=cgroup/v2\nConstrainDevices=yes\n", "fail", "Hybrid mode is not supported"),
    (HYBRID, "CgroupPlugin=cgroup/v1\nConstrainDevices=yes\n", "fail", "no devices controller"),
    (UNIFIED, "ConstrainDevices=no\n", "ok", "nothing to grant"),
    (HYBRID, None, "ok", "nothing to grant"),
])
def test_device_control_says_whether_a_grant_can_work_here(tmp_path, mounts, cgroup, status, says):
    cfg, where = _node(tmp_path, mounts, cgroup)
    c = doctor.check_device_control(cfg, "n1", **where)
    assert c.status == status and says in c.reason, c


def test_a_recent_grant_failure_is_a_warning_that_names_it(tmp_path):
    cfg, where = _node(tmp_path, UNIFIED, "ConstrainDevices=yes\n")
    device_failure.record(tmp_path / "state" / "n1", "77", "a device program with BPF_F_ALLOW_MULTI", now=1000.0)
    c = doctor.check_device_control(cfg, "n1", now=1010.0, **where)
    assert c.status == "warn" and "job 77's GPU could not be granted here" in c.reason, c
    assert "ALLOW_MULTI" in c.reason and "cannot allow its GPU" in c.hint
    assert doctor.check_device_control(cfg, "n1", now=1000.0 + device_failure.HOLD_S + 1, **where).status == "ok"
    assert doctor.check_device_control(cfg, "other", now=1010.0, **where).status == "ok"  # another node's record
