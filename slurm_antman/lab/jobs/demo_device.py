"""The demo jobs' GPU work on the contending emulated GPU (``evaluation/contended_gpu``), so
that ``antman demo`` shows the guaranteed job slowed by its neighbour's real timing and the node loop
answering it, not a number read from a formula.

Opt-in: a job uses it when ``ANTMAN_DEMO_DEVICE_ROOT`` names the directory of the node's device
servers (the demo sets it; the cluster tests that run these scripts leave it unset and the jobs stay as
they were). The GPU is the job's own (``CUDA_VISIBLE_DEVICES`` or the antman GPU list), the node
``SLURMD_NODENAME``: two jobs on one GPU share one device, which runs one job's kernels at a time.
"""

from __future__ import annotations

import os
from typing import Any, Optional

ENV_ROOT = "ANTMAN_DEMO_DEVICE_ROOT"


class DemoDevice:
    """``step(gpu_s)``: the step's GPU work as kernel launches (module calls, which the agent's
    launch-mode throttle hooks), then a synchronize, as ``loss.item()`` does."""

    def __init__(self, dev: Any, agent: Any) -> None:
        # The emulated job's own launch module and throttle hook-up: one way to put work on the device.
        from slurm_antman.lab.evaluation.emulated_job import KERNEL_MAX_S, EmulatedJob, _launch_class

        self.dev = dev
        self.kernel_max_s = KERNEL_MAX_S
        self.launch = _launch_class()(dev)
        if agent is not None:
            EmulatedJob._throttle_synchronizes(agent.throttle, dev)

    @classmethod
    def from_env(cls, job_name: str, agent: Any, env: Optional[dict] = None) -> Optional["DemoDevice"]:
        env = os.environ if env is None else env
        root = env.get(ENV_ROOT)
        if not root:
            return None
        from slurm_antman.lab.evaluation.contended_gpu import ContendedDevice
        from slurm_antman.lab.evaluation.emulated_job import identity_from_env

        ident = identity_from_env(env)
        return cls(ContendedDevice(root, ident.node, ident.gpus, f"{job_name}-{ident.job_id}"), agent)

    def step(self, gpu_s: float) -> None:
        from slurm_antman.lab.evaluation.contended_gpu import minibatch

        minibatch(self.dev, gpu_s, 0.0, self.kernel_max_s, launch=self.launch)

    def close(self) -> None:
        self.dev.close()
