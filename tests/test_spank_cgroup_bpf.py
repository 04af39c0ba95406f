"""The cgroup v2 device grant of the SPANK plugin (spank/cgroup_bpf.c), against the kernel, for real.

Under cgroup v2 Slurm confines a job's devices with eBPF programs (BPF_PROG_TYPE_CGROUP_DEVICE) that it
attaches to the job's cgroup and its step and task cgroups; the plugin gives an opportunistic job's task
its placed GPU by attaching to the task's own cgroup a copy of the program in effect there behind a prefix
that allows that GPU. Device programs run on the cgroup2 hierarchy even where cgroup v1 controllers are
mounted beside it (a hybrid host, like this project's development machine, which has an empty cgroup2
hierarchy at /sys/fs/cgroup/unified), so the mechanism runs here without Slurm: the test builds a job-like
tree of cgroups, attaches Slurm-like programs itself (tests/c/bpf_grant_driver.c: deny c 195:0-3 but the
job's own GRES GPU, accept everything else; BPF_F_ALLOW_OVERRIDE at the job and at step_N/user, flags 0
at task_N, as src/plugins/cgroup/v2/cgroup_v2.c does), has the plugin's code amend the task's program,
and opens fake GPUs (c 195 N nodes; no driver serves major 195 here, so an allowed open fails with ENXIO
and a denied one with EPERM) from a process moved into the task's cgroup. On top of it, spank/devices.c's
cgroup v2 path (tests/c/devices_grant_driver.c, with the host made to look unified): the checks of the
task's cgroup path, the node taken from the scope, and the failure text.

Needs root, gcc, a cgroup2 mount and a kernel that lets root attach device programs; skips with the
reason otherwise. Every cgroup it makes is removed again (processes moved out, then bottom up), also when
a test fails.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
DRIVER_SRC = REPO / "tests" / "c" / "bpf_grant_driver.c"
DEVICES_DRIVER_SRC = REPO / "tests" / "c" / "devices_grant_driver.c"
LIBRARY_SRC = REPO / "spank" / "cgroup_bpf.c"
DEVICES_SRC = REPO / "spank" / "devices.c"
NVIDIA_MAJOR = 195

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed"),
]

V1_CONTROLLERS = {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "blkio",
                  "perf_event", "net_prio", "hugetlb", "pids", "rdma", "misc"}


def _mounts(text: str) -> list[tuple[str, str, list[str]]]:
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4:
            out.append((f[1], f[2], f[3].split(",")))
    return out


def _cgroup2_mount() -> Optional[Path]:
    for where, kind, _ in _mounts(Path("/proc/self/mounts").read_text()):
        if kind == "cgroup2":
            return Path(where)
    return None


def _kv(line: str) -> dict[str, str]:
    """'rc=1 errno=- cause=a b c' -> {'rc': '1', 'errno': '-', 'cause': 'a b c'} (cause and failure run to
    the end)."""
    out: dict[str, str] = {}
    rest = line.strip()
    while rest:
        key, _, rest = rest.partition("=")
        if key in ("cause", "failure"):
            out[key] = rest
            break
        value, _, rest = rest.partition(" ")
        out[key] = value
    return out


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/c/bpf_grant_driver.c linked with spank/cgroup_bpf.c, with the plugin's warning flags."""
    exe = tmp_path_factory.mktemp("bpf-driver") / "bpf_grant_driver"
    res = subprocess.run(["gcc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-Wshadow", "-Wformat=2",
                          f"-I{REPO / 'spank'}", "-o", str(exe), str(DRIVER_SRC), str(LIBRARY_SRC)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"the driver does not build:\n{res.stderr}"
    return exe


def run(driver: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(driver), *args], capture_output=True, text=True, timeout=30)


_names = itertools.count()


class Tree:
    """Cgroups made under the cgroup2 mount for one test: antman-test-PID-N/..., removed by cleanup()."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.name = f"antman-test-{os.getpid()}-{next(_names)}"
        self.root = mount / self.name
        self.made: list[Path] = []
        self.mkdir("")

    def mkdir(self, rel: str) -> Path:
        path = self.root
        for part in [p for p in rel.split("/") if p]:
            path = path / part
            if not path.exists():
                path.mkdir()
                self.made.append(path)
        if not rel and path not in self.made:
            path.mkdir()
            self.made.append(path)
        return path

    def cg(self, rel: str) -> str:
        """The path as /proc/PID/cgroup spells it (relative to the cgroup2 mount)."""
        return f"/{self.name}/{rel}".rstrip("/")

    def cleanup(self) -> list[str]:
        """Moves every process out (and kills it: only this test's children can be in here), then removes
        the cgroups bottom up. Returns what could not be removed."""
        left = []
        for path in sorted(self.made, key=lambda p: len(p.parts), reverse=True):
            for _ in range(50):
                try:
                    pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
                except FileNotFoundError:
                    break
                for pid in pids:
                    try:
                        (self.mount / "cgroup.procs").write_text(str(pid))
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, OSError):
                        pass
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        left.append(f"{path}: {e}")
                        break
                    time.sleep(0.05)
            else:
                left.append(f"{path}: still busy")
        return left


@pytest.fixture(scope="module")
def cgroup2(driver: Path) -> Path:
    """The cgroup2 mount point, once root has shown here that it may attach a device program there."""
    if os.geteuid() != 0:
        pytest.skip("creates cgroups and attaches BPF programs: needs root")
    mount = _cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy is mounted on this host: device programs cannot be attached")
    tree = Tree(mount)
    try:
        res = run(driver, "attach", str(tree.root), "override", "allow-all")
    finally:
        left = tree.cleanup()
    if res.returncode != 0:
        pytest.skip(f"the kernel refuses root a cgroup device program on {mount} "
                    f"({res.stdout.strip() or res.stderr.strip()}): bpf() or BPF_PROG_ATTACH is not "
                    "available here (CONFIG_CGROUP_BPF, a seccomp filter, a lockdown?)")
    assert not left, f"could not remove the probe cgroup: {left}"
    return mount


@pytest.fixture
def tree(cgroup2: Path) -> Iterator[Tree]:
    t = Tree(cgroup2)
    try:
        yield t
    finally:
        left = t.cleanup()
        assert not left, f"cgroups left behind: {left}"


@pytest.fixture
def gpus(tmp_path: Path) -> list[str]:
    """Four fake GPUs, c 195:0-3, that no driver serves: an allowed open fails with ENXIO."""
    d = tmp_path / "dev"
    d.mkdir()
    paths = []
    for minor in range(4):
        p = d / f"nvidia{minor}"
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, minor))
        paths.append(str(p))
    try:
        os.close(os.open(paths[0], os.O_RDWR))
    except OSError as e:
        if e.errno == errno.EACCES:
            pytest.skip(f"{tmp_path} is on a file system mounted nodev: device nodes cannot be opened there")
        if e.errno == errno.EPERM:
            pytest.skip("a device program or devices cgroup of this test's own process denies c 195:*")
        assert e.errno == errno.ENXIO, e
    return paths


def probe(driver: Path, cgroup_dir: Path, files: list[str]) -> dict[str, str]:
    """Opens each file from a child moved into cgroup_dir: {basename: 'ok' | 'ENXIO' | 'EPERM' | ...}."""
    res = run(driver, "probe", str(cgroup_dir), *files)
    assert res.returncode == 0, f"probe failed: {res.stdout} {res.stderr}"
    out = {}
    for line in res.stdout.splitlines():
        path, _, result = line.rpartition(" ")
        out[os.path.basename(path)] = result
    return out


def query(driver: Path, cgroup_dir: Path) -> dict[str, str]:
    res = run(driver, "query", str(cgroup_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    return _kv(res.stdout)


def attach(driver: Path, cgroup_dir: Path, flags: str, kind: str = "slurm", job_minor: int = -1) -> None:
    res = run(driver, "attach", str(cgroup_dir), flags, kind, str(job_minor))
    assert res.returncode == 0 and res.stdout.strip() == "attached", res.stdout + res.stderr


def allow(driver: Path, mount: Path, cgroup: str, devices: str) -> dict[str, str]:
    res = run(driver, "allow", str(mount), cgroup, devices)
    assert res.returncode == 0, res.stdout + res.stderr
    return _kv(res.stdout)


def srun_like_job(driver: Path, tree: Tree, job: str, job_minor: int) -> None:
    """Slurm's programs for a job step launched by srun: job and step_0/user (ALLOW_OVERRIDE), task_0 and
    task_1 (flags 0), each denying c 195:0-3 but the job's own GRES GPU."""
    for rel in (f"{job}/step_0/user/task_0", f"{job}/step_0/user/task_1"):
        tree.mkdir(rel)
    attach(driver, tree.root / job, "override", job_minor=job_minor)
    attach(driver, tree.root / job / "step_0" / "user", "override", job_minor=job_minor)
    for task in ("task_0", "task_1"):
        attach(driver, tree.root / job / "step_0" / "user" / task, "none", job_minor=job_minor)


# ---- what controls devices: the mount table ----

UNIFIED = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n"
HYBRID = """tmpfs /sys/fs/cgroup tmpfs ro,nosuid,nodev,noexec,mode=755 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec,relatime 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,nosuid,nodev,noexec,relatime,xattr,name=systemd 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0
"""
V1_AND_UNIFIED = HYBRID + "cgroup /sys/fs/cgroup/devices cgroup rw,nosuid,nodev,noexec,relatime,devices 0 0\n"
V1_ONLY = "cgroup /cg/devices cgroup rw,relatime,devices 0 0\ncgroup /cg/pids cgroup rw,relatime,pids 0 0\n"
NAMED_AND_UNIFIED = ("cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,xattr,name=systemd 0 0\n"
                     "cgroup2 /sys/fs/cgroup cgroup2 rw,relatime 0 0\n")


@pytest.mark.parametrize("table, want", [
    (UNIFIED, "devctl=unified v1_devices=- v2=/sys/fs/cgroup v1_controllers=0"),
    (HYBRID, "devctl=hybrid v1_devices=- v2=/sys/fs/cgroup/unified v1_controllers=1"),
    (V1_AND_UNIFIED, "devctl=v1 v1_devices=/sys/fs/cgroup/devices v2=/sys/fs/cgroup/unified v1_controllers=1"),
    (V1_ONLY, "devctl=v1 v1_devices=/cg/devices v2=- v1_controllers=1"),
    (NAMED_AND_UNIFIED, "devctl=unified v1_devices=- v2=/sys/fs/cgroup v1_controllers=0"),
    ("proc /proc proc rw 0 0\n", "devctl=none v1_devices=- v2=- v1_controllers=0"),
    (None, "devctl=none v1_devices=- v2=- v1_controllers=0"),
], ids=["unified", "hybrid", "v1-with-unified", "v1-only", "named-hierarchy-and-unified", "none", "unreadable"])
def test_device_control_from_the_mount_table(driver: Path, tmp_path: Path, table: Optional[str], want: str) -> None:
    f = tmp_path / "mounts"
    if table is not None:
        f.write_text(table)
    assert run(driver, "devctl", str(f)).stdout.strip() == want


def test_device_control_of_this_host(driver: Path) -> None:
    mounts = _mounts(Path("/proc/self/mounts").read_text())
    v1 = [(w, o) for w, k, o in mounts if k == "cgroup" and V1_CONTROLLERS & set(o)]
    devices = next((w for w, o in v1 if "devices" in o), None)
    v2 = next((w for w, k, _ in mounts if k == "cgroup2"), None)
    want = "v1" if devices else ("hybrid" if v1 else "unified") if v2 else "none"
    got = _kv(run(driver, "devctl", "/proc/self/mounts").stdout)
    assert got["devctl"] == want
    assert got["v2"] == (v2 or "-") and got["v1_devices"] == (devices or "-")


# ---- the kernel ----

def test_the_kernel_rules_the_design_relies_on(driver: Path, tree: Tree) -> None:
    """kernel/bpf/cgroup.c as observed here: one program per cgroup without ALLOW_MULTI, replaced by an
    attach with the same flags, refused with other flags or below a program attached with flags 0."""
    task = tree.mkdir("job_1/step_0/user/task_0")
    attach(driver, tree.root / "job_1", "override", job_minor=0)
    attach(driver, task, "none", job_minor=0)
    before = query(driver, task)
    attach(driver, task, "none", job_minor=0)  # as a second attach of Slurm's would: replaced
    after = query(driver, task)
    assert after["own"] == "1" and after["effective"] == "1" and after["ids"] != before["ids"]
    assert run(driver, "attach", str(task), "override", "slurm").stdout.strip() == "error=EPERM step=attach"
    assert run(driver, "attach", str(tree.root / "job_1"), "multi", "slurm").stdout.strip() == \
        "error=EPERM step=attach"
    below = tree.mkdir("job_2/step_batch/user/task_0")
    attach(driver, tree.root / "job_2", "none", job_minor=0)
    assert run(driver, "attach", str(below), "none", "slurm").stdout.strip() == "error=EPERM step=attach"


def test_pid_path_is_the_kernels(driver: Path, tree: Tree) -> None:
    task = tree.mkdir("job_3/step_0/user/task_0")
    child = subprocess.Popen(["sleep", "60"])
    try:
        (task / "cgroup.procs").write_text(str(child.pid))
        got = _kv(run(driver, "pidpath", str(child.pid)).stdout)
        lines = Path(f"/proc/{child.pid}/cgroup").read_text().splitlines()
        held_by_v1 = any(V1_CONTROLLERS & set(line.split(":")[1].split(",")) for line in lines
                         if not line.startswith("0::"))
    finally:
        child.kill()
        child.wait()
    assert got == {"rc": "0", "path": tree.cg("job_3/step_0/user/task_0"), "unified_only": str(int(not held_by_v1))}
    assert _kv(run(driver, "pidpath", "999999999").stdout)["rc"] == "-1"


def test_an_srun_task_opens_its_placed_gpu_and_nothing_more(driver: Path, tree: Tree, gpus: list[str]) -> None:
    srun_like_job(driver, tree, "job_7", job_minor=0)
    task_0 = tree.root / "job_7" / "step_0" / "user" / "task_0"
    task_1 = tree.root / "job_7" / "step_0" / "user" / "task_1"
    files = gpus + ["/dev/null"]
    # Slurm's rules alone: the job's own GRES GPU, not the placed one.
    assert probe(driver, task_0, files) == {"nvidia0": "ENXIO", "nvidia1": "EPERM", "nvidia2": "EPERM",
                                            "nvidia3": "EPERM", "null": "ok"}

    assert allow(driver, tree.mount, tree.cg("job_7/step_0/user/task_0"), "195:2") == \
        {"rc": "1", "errno": "-", "cause": ""}

    q = query(driver, task_0)
    assert (q["own"], q["flags"], q["effective"], q["name"]) == ("1", "0", "1", "antman_devices")
    assert probe(driver, task_0, files) == {"nvidia0": "ENXIO", "nvidia1": "EPERM", "nvidia2": "ENXIO",
                                            "nvidia3": "EPERM", "null": "ok"}
    # Only the task's own cgroup was amended: its sibling keeps Slurm's program.
    assert query(driver, task_1)["name"] == "slurm_like"
    assert probe(driver, task_1, files)["nvidia2"] == "EPERM"


def test_a_batch_task_gets_a_program_of_its_own(driver: Path, tree: Tree, gpus: list[str]) -> None:
    """Batch, extern and interactive steps get only the job's program (src/plugins/cgroup/v2/cgroup_v2.c):
    the task's cgroup has none, so the amended copy of the job's program is attached there."""
    task = tree.mkdir("job_8/step_batch/user/task_0")
    attach(driver, tree.root / "job_8", "override", job_minor=1)
    assert query(driver, task)["own"] == "0"

    assert allow(driver, tree.mount, tree.cg("job_8/step_batch/user/task_0"), "195:2,195:3")["rc"] == "1"

    q = query(driver, task)
    assert (q["own"], q["flags"], q["name"]) == ("1", "0", "antman_devices")
    want = {"nvidia0": "EPERM", "nvidia1": "ENXIO", "nvidia2": "ENXIO", "nvidia3": "ENXIO", "null": "ok"}
    assert probe(driver, task, gpus + ["/dev/null"]) == want
    # A new step's slurmstepd replaces the job-level program: the task's own program still decides.
    job_before = query(driver, tree.root / "job_8")["ids"]
    attach(driver, tree.root / "job_8", "override", job_minor=1)
    assert query(driver, tree.root / "job_8")["ids"] != job_before
    assert probe(driver, task, gpus + ["/dev/null"]) == want


def test_no_program_means_nothing_to_do(driver: Path, tree: Tree) -> None:
    tree.mkdir("job_11/step_0/user/task_0")
    got = allow(driver, tree.mount, tree.cg("job_11/step_0/user/task_0"), "195:2")
    assert got["rc"] == "0" and got["cause"].startswith("nothing to do")
    assert query(driver, tree.root / "job_11" / "step_0" / "user" / "task_0")["own"] == "0"
    assert _kv(run(driver, "confined", str(tree.mount), tree.cg("job_11/step_0/user/task_0")).stdout)["rc"] == "0"
    attach(driver, tree.root / "job_11", "override", job_minor=0)
    assert _kv(run(driver, "confined", str(tree.mount), tree.cg("job_11/step_0/user/task_0")).stdout)["rc"] == "1"


def _multi_at_the_job(driver: Path, tree: Tree) -> str:
    # A second program at one level can only be there with ALLOW_MULTI, and then both are MULTI.
    tree.mkdir("job_9/step_0/user/task_0")
    attach(driver, tree.root / "job_9", "multi", job_minor=0)
    attach(driver, tree.root / "job_9", "multi", "allow-all")
    attach(driver, tree.root / "job_9" / "step_0" / "user", "override", job_minor=0)
    attach(driver, tree.root / "job_9" / "step_0" / "user" / "task_0", "none", job_minor=0)
    assert query(driver, tree.root / "job_9" / "step_0" / "user" / "task_0")["effective"] == "3"
    return "job_9/step_0/user/task_0"


def _no_override_at_the_job(driver: Path, tree: Tree) -> str:
    tree.mkdir("job_10/step_batch/user/task_0")
    attach(driver, tree.root / "job_10", "none", job_minor=0)
    return "job_10/step_batch/user/task_0"


def _too_large(driver: Path, tree: Tree) -> str:
    tree.mkdir("job_12/step_batch/user/task_0")
    attach(driver, tree.root / "job_12", "override", "big")
    return "job_12/step_batch/user/task_0"


def _calls_a_helper(driver: Path, tree: Tree) -> str:
    tree.mkdir("job_13/step_batch/user/task_0")
    attach(driver, tree.root / "job_13", "override", "helper")
    return "job_13/step_batch/user/task_0"


@pytest.mark.parametrize("make, err, cause", [
    (_multi_at_the_job, "EEXIST", "a device program attached with BPF_F_ALLOW_MULTI applies to the cgroup"),
    (_no_override_at_the_job, "EPERM",
     "the device program in effect is attached to an ancestor without BPF_F_ALLOW_OVERRIDE"),
    (_too_large, "E2BIG", "the device program in effect is too large to amend"),
    (_calls_a_helper, "EINVAL", "the device program in effect uses helpers or maps and cannot be copied"),
], ids=["allow-multi-at-the-job", "flags-0-at-the-job", "too-large", "helper-call"])
def test_an_unexpected_state_is_refused_with_a_cause(driver: Path, tree: Tree, make, err: str, cause: str) -> None:
    rel = make(driver, tree)
    task = tree.root / rel
    before = query(driver, task)
    assert allow(driver, tree.mount, tree.cg(rel), "195:2") == {"rc": "-1", "errno": err, "cause": cause}
    assert query(driver, task) == before  # nothing attached


@pytest.mark.parametrize("rel, err, cause", [
    ("job_7/../job_7/step_0/user/task_0", "EINVAL", "the cgroup path has an empty, . or .. component"),
    ("job_7//step_0/user/task_0", "EINVAL", "the cgroup path has an empty, . or .. component"),
    ("job_7/step_0/user/task_9", "ENOENT", "cannot open the cgroup directory"),
], ids=["dot-dot", "empty-component", "missing"])
def test_a_bad_path_is_refused(driver: Path, tree: Tree, rel: str, err: str, cause: str) -> None:
    srun_like_job(driver, tree, "job_7", job_minor=0)
    assert allow(driver, tree.mount, tree.cg(rel), "195:2") == {"rc": "-1", "errno": err, "cause": cause}


# ---- the plugin's cgroup v2 path (spank/devices.c) on top of it ----

FAILURE_CHARSET = re.compile(r"[A-Za-z0-9 _:.,()/-]+")


@pytest.fixture(scope="module")
def devices_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/c/devices_grant_driver.c linked with spank/devices.c and spank/cgroup_bpf.c; the mount table
    and the task's /proc/PID/cgroup look unified to devices.c (--wrap), whatever this host is."""
    if not Path("/usr/include/slurm/spank.h").exists():
        pytest.skip("Slurm headers (libslurm-dev) are not installed: spank/devices.c includes slurm/spank.h")
    exe = tmp_path_factory.mktemp("devices-driver") / "devices_grant_driver"
    res = subprocess.run(["gcc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-Wshadow",
                          f"-I{REPO / 'spank'}", "-Wl,--wrap=cgroup_device_control",
                          "-Wl,--wrap=cgroup_pid_v2_path", "-o", str(exe), str(DEVICES_DRIVER_SRC),
                          str(DEVICES_SRC), str(LIBRARY_SRC)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"the devices driver does not build:\n{res.stderr}"
    return exe


def grant(devices_driver: Path, job_id: int, cgroup_dir: Path, devices: Optional[str]) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin"}
    if devices is not None:
        env["DEVICES"] = devices
    res = subprocess.run([str(devices_driver), str(job_id), str(cgroup_dir)], capture_output=True, text=True,
                         timeout=30, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return _kv(res.stdout)


def test_the_plugin_allows_the_placed_gpu_to_its_task(devices_driver: Path, driver: Path, tree: Tree,
                                                       gpus: list[str]) -> None:
    """slurmd -N n1 on a host running several: the scope names the node, whose env file is read."""
    job = "system.slice/n1_slurmstepd.scope/job_12"
    srun_like_job(driver, tree, job, job_minor=0)
    task = tree.root / job / "step_0" / "user" / "task_0"
    assert grant(devices_driver, 12, task, "195:2") == {"rc": "0", "node": "n1", "failure": ""}
    assert query(driver, task)["name"] == "antman_devices"
    assert probe(driver, task, gpus[:3]) == {"nvidia0": "ENXIO", "nvidia1": "EPERM", "nvidia2": "ENXIO"}


def test_the_plugin_takes_a_sluid_job_directory(devices_driver: Path, driver: Path, tree: Tree,
                                                 gpus: list[str]) -> None:
    """Slurm 26.05 names the job's cgroup by its SLUID; a single slurmd's scope names no node."""
    task = tree.mkdir("system.slice/slurmstepd.scope/sBR1JB8J1YM400/step_batch/user/task_0")
    attach(driver, task.parent.parent.parent, "override", job_minor=0)
    assert grant(devices_driver, 99, task, "195:1,195:3") == {"rc": "0", "node": "-", "failure": ""}
    assert probe(driver, task, gpus) == {"nvidia0": "ENXIO", "nvidia1": "ENXIO", "nvidia2": "EPERM",
                                         "nvidia3": "ENXIO"}


def test_without_placed_devices_slurms_rules_stand(devices_driver: Path, driver: Path, tree: Tree) -> None:
    srun_like_job(driver, tree, "job_12", job_minor=0)
    task = tree.root / "job_12" / "step_0" / "user" / "task_0"
    assert grant(devices_driver, 12, task, None) == {"rc": "0", "node": "-", "failure": ""}
    assert query(driver, task)["name"] == "slurm_like"


def test_an_unconfined_cgroup_that_is_not_slurms_is_left_alone(devices_driver: Path, tree: Tree) -> None:
    """No task/cgroup (or ConstrainDevices=no): no device program applies, nothing was taken away."""
    assert grant(devices_driver, 12, tree.mkdir("system.slice/slurmd.service"), "195:2")["rc"] == "0"


def _task_of_job_12(driver: Path, tree: Tree) -> Path:
    srun_like_job(driver, tree, "job_12", job_minor=0)
    return tree.root / "job_12" / "step_0" / "user" / "task_0"


def _not_a_task_cgroup(driver: Path, tree: Tree) -> Path:
    srun_like_job(driver, tree, "job_12", job_minor=0)
    return tree.mkdir("job_12/step_0/other/task_0")


def _flags_0_at_the_job(driver: Path, tree: Tree) -> Path:
    task = tree.mkdir("job_12/step_batch/user/task_0")
    attach(driver, tree.root / "job_12", "none", job_minor=0)
    return task


NOT_SLURMS = ("cannot allow its GPU 195:2 on this cgroup v2 node: the task is not in a Slurm task cgroup "
              "(JOB/step_S/user/task_T) of this job")


@pytest.mark.parametrize("make, job_id, devices, failure", [
    (_task_of_job_12, 77, "195:2", NOT_SLURMS),
    (_not_a_task_cgroup, 12, "195:2", NOT_SLURMS),
    (_flags_0_at_the_job, 12, "195:2", "cannot allow its GPU 195:2 on this cgroup v2 node: the device program in "
     "effect is attached to an ancestor without BPF_F_ALLOW_OVERRIDE (Operation not permitted)"),
    (_task_of_job_12, 12, "195:x", "cannot allow its GPUs: ANTMAN_GPU_DEVICES in its env file is not a list of "
     "MAJOR:MINOR"),
], ids=["another-jobs-cgroup", "not-a-task-cgroup", "flags-0-at-the-job", "bad-env-value"])
def test_the_plugin_fails_closed_with_its_own_words(devices_driver: Path, driver: Path, tree: Tree, make,
                                                    job_id: int, devices: str, failure: str) -> None:
    """One text for the log line and for ANTMAN_DEVICE_FAILURE: fixed words, device numbers, errno text."""
    task = make(driver, tree)
    before = query(driver, task)
    got = grant(devices_driver, job_id, task, devices)
    assert got["rc"] == "-1" and got["failure"] == failure
    assert FAILURE_CHARSET.fullmatch(got["failure"])
    assert query(driver, task) == before
