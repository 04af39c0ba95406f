"""Typed failures of Slurm commands.

Each carries the command that was run and Slurm's own message, because "sbatch failed" is useless to
a user while "Batch job submission failed: Invalid partition name specified" tells them what to fix.
"""

from __future__ import annotations

import shlex
from typing import Optional, Sequence

from ..errors import AntmanError


class SlurmError(AntmanError):
    """Base of every Slurm adapter error."""

    def __init__(self, message: str, command: Optional[Sequence[str]] = None, stderr: str = "",
                 returncode: Optional[int] = None):
        self.message = message
        self.command = list(command) if command else []
        self.stderr = stderr.strip()
        self.returncode = returncode
        super().__init__(message)

    @property
    def command_line(self) -> str:
        return shlex.join(self.command)

    def __str__(self) -> str:
        where = f" (command: {self.command_line})" if self.command else ""
        return f"{self.message}{where}"


class JobNotFound(SlurmError):
    """Slurm does not know the job (never existed, or purged after MinJobAge)."""

    def __init__(self, job_id: int | str, command: Optional[Sequence[str]] = None, stderr: str = "",
                 returncode: Optional[int] = None):
        self.job_id = job_id
        detail = stderr.strip() or "Invalid job id specified"
        super().__init__(f"job {job_id} not found: {detail}", command, stderr, returncode)


class SubmissionRejected(SlurmError):
    """sbatch refused the job (bad option, unknown partition, a job_submit plugin said no...)."""


class SlurmUnavailable(SlurmError):
    """The controller could not be reached, a command timed out, or the commands are not installed."""


class CommandFailed(SlurmError):
    """A Slurm command failed for a reason that is none of the more specific ones."""


class SlurmOutputError(SlurmError):
    """A command succeeded but printed something this adapter cannot parse."""


class WaitTimeout(SlurmError):
    """wait_for gave up: the job did not reach one of the wanted states in time."""


class JobEnded(SlurmError):
    """wait_for saw the job finish in a state other than the ones waited for."""
