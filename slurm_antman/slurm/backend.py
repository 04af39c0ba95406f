"""The one interface the rest of slurm-antman uses to talk to Slurm.

Only the CLI backend (:mod:`.cli_backend`) ships: it works with every Slurm version and is what the
tests exercise against a real 22.05 cluster. A pyslurm backend can be added as another subclass of
:class:`SlurmBackend` (same methods, same models, same errors) where a pyslurm build matching the
site's Slurm exists; PyPI's pyslurm is built for Slurm 25.11 only and refuses 22.05, so none is
shipped here.
"""

from __future__ import annotations

import abc
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

from .errors import JobEnded, WaitTimeout
from .models import TERMINAL_STATES, Job, Node
from .parsing import normalise_state

Options = Union[Sequence[str], Mapping[str, Union[str, int, float, bool, None]]]


class SlurmBackend(abc.ABC):
    """Submit, inspect and steer jobs. Job ids are ints; states are normalised upper-case names."""

    @abc.abstractmethod
    def submit(self, script: Union[str, Path, None] = None, *, wrap: Optional[str] = None,
               script_text: Optional[str] = None, options: Options = (),
               env: Optional[Mapping[str, str]] = None) -> int:
        """Submit a batch job: a script file, a ``wrap`` command line, or the text of a script.
        ``options`` are sbatch options (``["--gres=gpu:2"]`` or ``{"gres": "gpu:2", "hold": True}``);
        ``env`` is added to the environment sbatch runs in (and so to the job's)."""

    @abc.abstractmethod
    def jobs(self, states: Optional[Iterable[str]] = None, users: Optional[Iterable[str]] = None) -> list[Job]:
        """All jobs the controller knows, optionally filtered by state and user."""

    @abc.abstractmethod
    def job(self, job_id: Union[int, str]) -> Job:
        """One job, in detail (physical GPU indices included); JobNotFound if Slurm does not know it.
        ``job_id`` is a raw id or an array task's ``ARRAY_TASK`` (``Job.slurm_id``)."""

    @abc.abstractmethod
    def requeue(self, job_id: Union[int, str], hold: bool = False) -> None: ...

    @abc.abstractmethod
    def hold(self, job_id: int) -> None: ...

    @abc.abstractmethod
    def release(self, job_id: int) -> None: ...

    @abc.abstractmethod
    def update(self, job_id: Union[int, str], **fields: Union[str, int]) -> None:
        """``scontrol update`` fields by Slurm name (``AdminComment="..."``, ``TimeLimit=10``) or in
        snake case (``admin_comment=...``)."""

    @abc.abstractmethod
    def cancel(self, job_id: int, signal: Optional[str] = None) -> None:
        """Cancel the job, or with ``signal`` only send it (to the batch shell and all steps)."""

    @abc.abstractmethod
    def signal(self, job_id: Union[int, str], signal: str, batch_only: bool = False) -> None:
        """Send ``signal`` to the job's batch shell only, or to it and every step, without ending the job;
        a job that has ended meanwhile is not an error."""

    @abc.abstractmethod
    def batch_script(self, job_id: Union[int, str]) -> str:
        """The job's batch script, as submitted."""

    @abc.abstractmethod
    def nodes(self) -> list[Node]: ...

    @abc.abstractmethod
    def update_node(self, node: str, **fields: Union[str, int]) -> None:
        """``scontrol update NodeName=node`` with fields by Slurm name (``Gres="gpu:4,antman_opp:8"``)."""

    @abc.abstractmethod
    def config(self) -> dict[str, str]:
        """The running Slurm's effective configuration (``scontrol show config``), key -> value."""

    @abc.abstractmethod
    def sbatch_help(self) -> str:
        """What ``sbatch --help`` prints here, SPANK plugins' options included."""

    @abc.abstractmethod
    def controller_time(self) -> float:
        """slurmctld's own clock, as a Unix time."""

    def wait_for(self, job_id: int, states: Iterable[str], timeout: float = 60.0,
                 first_delay: float = 0.2, max_delay: float = 5.0) -> Job:
        """Poll ``job()`` with growing delays until the job is in one of ``states``.

        Raises WaitTimeout after ``timeout`` seconds, JobEnded if the job finished in a state that
        was not asked for (waiting longer could not help).
        """
        wanted = {normalise_state(s) for s in states}
        if not wanted:
            raise ValueError("wait_for needs at least one state to wait for")
        deadline = time.monotonic() + timeout
        delay = first_delay
        while True:
            job = self.job(job_id)
            if job.state in wanted:
                return job
            if job.state in TERMINAL_STATES:
                raise JobEnded(f"job {job_id} ended {job.state} (reason {job.reason or 'none'}) "
                               f"while waiting for {'/'.join(sorted(wanted))}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"job {job_id} still {job.state} (reason {job.reason or 'none'}) after "
                                  f"{timeout:g} s waiting for {'/'.join(sorted(wanted))}")
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, max_delay)
