"""A discrete-event replay of a trace on a simulated GPU cluster, under the policies a Slurm site
would choose between and under antman's production policy code (docs/evaluation.md).

- ``engine``: the event loop, each job's life from submission to its end, the metrics.
- ``scheduler``: Slurm's scheduler under each policy (the exclusive, quota, scavenger and shared
  baselines are this alone), with EASY backfill's reservation (``backfill``) and where an opportunistic
  job may go (``opp_place``).
- ``interference``: the GPU physics: progress beside neighbours, utilisation, memory, OOM.
- ``antman``: the adapter that drives the real cluster and node policies.
- ``config``, ``state``: the settings, and what is kept of each job and GPU.
- ``parallel``: several runs of one trace in processes of their own (``--jobs N``).
"""

from .config import NO_ROOM, POLICIES, WHOLE_GPU, SimConfig
from .engine import Simulator, simulate, tenant_quotas
from .interference import SPILL_RATE
from .state import SimResult

__all__ = ["NO_ROOM", "POLICIES", "SPILL_RATE", "WHOLE_GPU", "SimConfig", "SimResult", "Simulator", "simulate",
           "tenant_quotas"]
