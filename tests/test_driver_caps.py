"""Driver-level memory caps: what decides whether a node has them, and which
cgroup a job's cap goes to. Setting a cap needs an NVIDIA driver r615+; that part is the gpu test."""

from __future__ import annotations

import os

import pytest

from slurm_antman.sidecar import driver_caps as dcap


@pytest.mark.parametrize("kw, expect", [
    (dict(binding=False, driver_version="615.10", cgroup2=True, mig=False), "nvidia-ml-py has no nvmlDeviceSetMemoryLimits_v1"),
    (dict(binding=True, driver_version=None, cgroup2=True, mig=False), "no NVML"),
    (dict(binding=True, driver_version="580.65.06", cgroup2=True, mig=False), "driver 580.65.06: MPS v3 memory partitioning needs r615"),
    (dict(binding=True, driver_version="x.y", cgroup2=True, mig=False), "driver version 'x.y' not understood"),
    (dict(binding=True, driver_version="615.01", cgroup2=False, mig=False), "no cgroup v2"),
    (dict(binding=True, driver_version="620.1", cgroup2=True, mig=True), "MIG is enabled"),
    (dict(binding=True, driver_version="615.01", cgroup2=True, mig=False), ""),
])
def test_why_a_node_has_no_driver_caps_is_specific(kw, expect):
    why = dcap.why_unsupported(**kw)
    assert why.startswith(expect) if expect else why == ""


def test_the_backend_is_dmem_only_when_the_kernel_lists_nvidia_regions():
    assert dcap.dmem_backend("nvidia/0000:3b:00.0/vidmem 85899345920\n") == "dmem"
    assert dcap.dmem_backend("drm/0000:00:02.0/vram0 1073741824\n") == "driver misc"
    assert dcap.dmem_backend(None) == "driver misc"


SLURM_CG = "0::/system.slice/slurmstepd.scope/job_12/step_0/user/task_0\n"


@pytest.mark.parametrize("text, job, expect", [
    (SLURM_CG, "12", "/system.slice/slurmstepd.scope/job_12"),
    (SLURM_CG, "13", None),                              # another job's process
    ("0::/system.slice/slurmstepd.scope/job_12/step_0/user/job_13\n", "13", None),  # a cgroup job 12 made
    ("12:memory:/slurm/uid_0/job_12\n", "12", None),     # cgroup v1: no driver caps there
    ("0::/user.slice/user-1000.slice/session-3.scope\n", "12", None),
    (SLURM_CG, "../12", None),
])
def test_a_cap_goes_to_the_slurm_cgroup_of_the_job_itself(text, job, expect):
    assert dcap.job_cgroup_path(text, job) == expect


def test_a_process_is_mapped_to_its_job_cgroup_through_proc(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text(SLURM_CG)
    caps = dcap.MemoryCaps(None, dcap.Support(""), cgroup_root=str(root), proc=str(proc))
    assert caps.cgroup_of("12", 4242) is None  # the kernel has no such cgroup: nothing to cap
    (root / "system.slice/slurmstepd.scope/job_12").mkdir(parents=True)
    assert caps.cgroup_of("12", 4242) == str(root / "system.slice/slurmstepd.scope/job_12")
    assert caps.cgroup_of("12", 4243) is None  # the process is gone


def test_without_nvml_the_node_says_so():
    s = dcap.detect(None)
    assert not s.available and s.describe() == "no driver memory caps (no NVML (no NVIDIA driver))"


@pytest.mark.gpu
def test_driver_caps_on_this_gpu_node():
    """On a GPU node: detection gives a driver version and either the backend or a specific reason.
    Where caps are available and this process may make cgroups, a cap below what a process then
    allocates makes that allocation fail with out-of-memory."""
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        pytest.skip(f"no NVML: {e}")
    try:
        s = dcap.detect(pynvml)
        print(f"driver caps: {s.describe()}")
        if not s.available:
            assert s.why_not and ("driver" in s.why_not or "cgroup" in s.why_not or "MIG" in s.why_not
                                  or "nvidia-ml-py" in s.why_not)
            pytest.skip(f"this node has no driver memory caps: {s.why_not}")
        assert s.backend in ("dmem", "driver misc")
    finally:
        pynvml.nvmlShutdown()
    if os.geteuid() != 0:
        pytest.skip("capping a cgroup needs root")
    import subprocess
    import sys

    cg = f"/sys/fs/cgroup/antman-cap-test-{os.getpid()}"
    os.mkdir(cg)
    try:
        pynvml.nvmlInit()
        try:
            caps = dcap.MemoryCaps(pynvml, s)
            assert caps.set("1", 0, cg, 256 << 20)
        finally:
            pynvml.nvmlShutdown()
        child = ("import torch; torch.cuda.init()\n"
                 "try:\n    torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); print('ALLOCATED')\n"
                 "except torch.OutOfMemoryError as e:\n    print('OOM', e)\n")

        def into_cgroup():
            with open(f"{cg}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

        r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                           preexec_fn=into_cgroup)
        print(r.stdout, r.stderr[-2000:])
        assert "OOM" in r.stdout, (r.stdout, r.stderr[-2000:])
    finally:
        os.rmdir(cg)
