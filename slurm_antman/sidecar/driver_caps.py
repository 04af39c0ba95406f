"""Driver-level GPU memory caps: a cap the job cannot bypass, where the driver has one.

NVIDIA's MPS v3 memory partitioning (driver r615 / CUDA 13.4 and newer, Linux cgroup v2) limits the
device memory a cgroup's processes may allocate: ``nvmlDeviceSetMemoryLimits_v1`` takes the cgroup's
sysfs path and a soft and a hard limit; an allocation past the hard limit fails with out-of-memory,
whatever the process does (NVIDIA, "MPS v3 Memory Partitioning", docs.nvidia.com/deploy/mps; the
struct is ``nvmlSetMemoryLimits_v1_t`` in the NVML API reference). The backend is the kernel's dmem
controller (kernel 6.14+: ``dmem.capacity`` lists ``nvidia/...`` regions) or the driver's own misc
backend on older kernels; MIG devices are not supported.

The sidecar sets each opportunistic job's hard cap on each of its GPUs to its memory limit plus the
compliance tolerance (what the agent keeps to, and what compliance would requeue it for exceeding),
soft 0 (nothing guaranteed), on the job's Slurm cgroup (``.../job_<id>``). The agent still does the
shrinking and spilling; the cap only stops a job that does not.

``why_unsupported`` is pure; the rest reads /proc and /sys and calls NVML.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional

MIN_DRIVER_MAJOR = 615  # r615: the first driver with MPS v3 memory partitioning (CUDA 13.4)
_CGROUP_V2_LINE = re.compile(r"^0::(/\S*)$", re.M)


def why_unsupported(*, binding: bool, driver_version: Optional[str], cgroup2: bool, mig: bool) -> str:
    """"" when the driver can cap a job's memory here, else why not (one line, for doctor and logs)."""
    if not binding:
        return "nvidia-ml-py has no nvmlDeviceSetMemoryLimits_v1 (needs 13.615 or newer)"
    if driver_version is None:
        return "no NVML (no NVIDIA driver)"
    try:
        major = int(driver_version.split(".")[0])
    except ValueError:
        return f"driver version {driver_version!r} not understood"
    if major < MIN_DRIVER_MAJOR:
        return f"driver {driver_version}: MPS v3 memory partitioning needs r{MIN_DRIVER_MAJOR} (CUDA 13.4) or newer"
    if not cgroup2:
        return "no cgroup v2 at /sys/fs/cgroup (memory partitioning caps cgroups)"
    if mig:
        return "MIG is enabled: memory partitioning does not support MIG devices"
    return ""


def dmem_backend(capacity_text: Optional[str]) -> str:
    """Which backend the driver uses: the kernel's dmem controller when it lists NVIDIA regions."""
    if capacity_text and any(line.split()[0].startswith("nvidia/") for line in capacity_text.splitlines()
                             if line.split()):
        return "dmem"
    return "driver misc"


def job_cgroup_path(cgroup_text: str, job_id: str) -> Optional[str]:
    """The cgroup v2 path of Slurm job ``job_id`` from a process's ``/proc/PID/cgroup``: its path up to
    the ``job_<id>`` component; None when the process is not in that job's cgroup. The kernel writes
    this file, and the path is cut at the job's own component, so nothing the job names is used."""
    if not job_id.isdigit():
        return None
    m = _CGROUP_V2_LINE.search(cgroup_text)
    if m is None:
        return None
    parts = m.group(1).split("/")
    # The first job_<n> is Slurm's; any deeper one is a cgroup the job made inside its own.
    first = next((i for i, part in enumerate(parts) if re.fullmatch(r"job_\d+", part)), None)
    if first is None or parts[first] != f"job_{job_id}":
        return None
    return "/".join(parts[: first + 1])


@dataclass(frozen=True)
class Support:
    why_not: str  # "" = caps can be set
    backend: str = ""

    @property
    def available(self) -> bool:
        return not self.why_not

    def describe(self) -> str:
        return (f"driver memory caps (MPS v3 memory partitioning, {self.backend} backend)" if self.available
                else f"no driver memory caps ({self.why_not})")


def detect(nvml: Any, cgroup_root: str = "/sys/fs/cgroup") -> Support:
    """What this node offers; ``nvml`` is the pynvml module, initialised, or None."""
    if nvml is None:
        return Support("no NVML (no NVIDIA driver)")
    binding = hasattr(nvml, "nvmlDeviceSetMemoryLimits_v1")
    try:
        raw = nvml.nvmlSystemGetDriverVersion()
        driver: Optional[str] = raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:  # noqa: BLE001 - any NVML failure means no driver to ask
        driver = None
    mig = False
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            current, _pending = nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByIndex(i))
            mig = mig or bool(current)
    except Exception:  # noqa: BLE001 - GPUs without MIG raise NotSupported: no MIG
        pass
    cgroup2 = os.path.exists(os.path.join(cgroup_root, "cgroup.controllers"))
    why = why_unsupported(binding=binding, driver_version=driver, cgroup2=cgroup2, mig=mig)
    if why:
        return Support(why)
    try:
        with open(os.path.join(cgroup_root, "dmem.capacity")) as f:
            capacity: Optional[str] = f.read()
    except OSError:
        capacity = None
    return Support("", dmem_backend(capacity))


class MemoryCaps:
    """Sets and clears caps through NVML; remembers what it set so that a cap is set once per change."""

    def __init__(self, nvml: Any, support: Support, cgroup_root: str = "/sys/fs/cgroup", proc: str = "/proc"):
        self.nvml = nvml
        self.support = support
        self.cgroup_root = cgroup_root
        self.proc = proc
        self.applied: dict[tuple[str, int], tuple[str, int]] = {}  # (job, gpu) -> (cgroup dir, hard bytes)

    def cgroup_of(self, job_id: str, pid: int) -> Optional[str]:
        try:
            with open(f"{self.proc}/{pid}/cgroup") as f:
                rel = job_cgroup_path(f.read(), job_id)
        except OSError:
            return None
        if rel is None:
            return None
        path = self.cgroup_root.rstrip("/") + rel
        return path if os.path.isdir(path) else None

    def set(self, job_id: str, gpu: int, cgroup_dir: str, hard_bytes: int) -> bool:
        """Cap ``job_id`` on ``gpu``; False when it was already capped so. Raises the NVML error."""
        if self.applied.get((job_id, gpu)) == (cgroup_dir, hard_bytes):
            return False
        self._call(gpu, cgroup_dir, 0, hard_bytes)
        self.applied[(job_id, gpu)] = (cgroup_dir, hard_bytes)
        return True

    def clear(self, job_id: str) -> None:
        """Lift every cap of ``job_id`` (it left, or no longer shares a GPU). Removing the cgroup would
        too; a job that goes on running without a neighbour must get its memory back."""
        for (j, gpu), (cgroup_dir, _hard) in list(self.applied.items()):
            if j != job_id:
                continue
            del self.applied[(j, gpu)]
            if os.path.isdir(cgroup_dir):
                self._call(gpu, cgroup_dir, 0, self.nvml.NVML_DEVICE_MEMORY_LIMIT_MAX)

    def _call(self, gpu: int, cgroup_dir: str, soft: int, hard: int) -> None:
        n = self.nvml
        limits = n.c_nvmlSetMemoryLimits_v1_t()
        limits.nameSpace = cgroup_dir.encode()
        limits.softLimit = soft
        limits.hardLimit = hard
        n.nvmlDeviceSetMemoryLimits_v1(n.nvmlDeviceGetHandleByIndex(gpu), limits)
