"""A Slurm backend that reads jobs through pyslurm (Slurm's C API) and does the rest through the CLI.

pyslurm is built against one Slurm release only (PyPI's 25.11.x refuses any other at build time), so it
is an option, never a requirement: :func:`available` says whether the pyslurm importable here was built
for the Slurm installed here. The reads the daemons repeat (the coordinator's snapshot: every job and
every node each cycle; a Prolog's read of its own job) go through the library; submissions, updates and
requeues keep the CLI's path, whose messages and typed errors the rest of the product relies on. Errors
are the adapter's own (``JobNotFound``, ``SlurmUnavailable``, ``SlurmError``), so no caller can tell the
backends apart but by speed: ``antman bench slurm-backend`` measures both on one cluster and checks that
they return the same records.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Iterable, Mapping, Optional

from . import version as slurm_version
from .cli_backend import DEFAULT_TIMEOUT_S, CliBackend
from .errors import JobNotFound, SlurmError, SlurmUnavailable
from .models import Job
from .parsing import _expand_nodes, _null, _physical_gpus, filter_jobs, normalise_state, parse_index_list
from .tag import read_admin_comment

_UNAVAILABLE_HINTS = ("Unable to contact slurm controller", "Connection refused", "Socket timed out",
                      "Zero Bytes were transmitted")


def _import() -> Any:
    import pyslurm  # noqa: PLC0415 - optional: imported only where it is asked for

    return pyslurm


def available(env_version: Optional[slurm_version.Version]) -> str:
    """"" when pyslurm is importable and built for the installed Slurm's release, else why not."""
    try:
        pyslurm = _import()
    except ImportError as e:
        return f"pyslurm is not installed ({e})"
    except Exception as e:  # noqa: BLE001 - pyslurm reads slurm.conf at import: a broken one is "not here"
        return f"pyslurm does not load ({type(e).__name__}: {e})"
    try:
        built = slurm_version.parse_version(str(pyslurm.__version__) + ".0")
    except SlurmError:
        return f"pyslurm's version {pyslurm.__version__!r} is not a Slurm release"
    if env_version is None or tuple(built[:2]) != tuple(env_version[:2]):
        have = slurm_version.fmt(env_version) if env_version else "unknown"
        return f"pyslurm {pyslurm.__version__} is built for Slurm {slurm_version.fmt(built[:2])}, not {have}"
    return ""


def _time(v: Any) -> Optional[dt.datetime]:
    if not v:
        return None
    return dt.datetime.fromtimestamp(int(v), tz=dt.timezone.utc)


def _tres_text(gres_per_node: Optional[Mapping[str, int]]) -> str:
    """pyslurm's ``{"gres/gpu": 2}`` as Slurm prints TresPerNode (``gres/gpu:2``)."""
    return ",".join(f"{k}:{v}" for k, v in (gres_per_node or {}).items())


class PyslurmBackend(CliBackend):
    """Reads jobs through pyslurm, everything else through the CLI (inherited)."""

    def __init__(self, env: Optional[Mapping[str, str]] = None, timeout: float = DEFAULT_TIMEOUT_S,
                 gres_name: str = "gpu") -> None:
        super().__init__(env=env, timeout=timeout, gres_name=gres_name)
        self._pyslurm = _import()

    def _rpc(self, what: str, call, job_id: Optional[int | str] = None):
        err = self._pyslurm.RPCError
        try:
            return call()
        except err as e:
            text = str(e)
            if job_id is not None and "Invalid job id" in text:
                raise JobNotFound(job_id, ["pyslurm", what], text) from None
            if any(h in text for h in _UNAVAILABLE_HINTS):
                raise SlurmUnavailable(f"Slurm controller unavailable: {text}", ["pyslurm", what], text) from None
            raise SlurmError(f"pyslurm {what} failed: {text}", ["pyslurm", what], text) from None

    def _job(self, j: Any) -> Job:
        layout = j.get_resource_layout_per_node() or {}
        gres_by_node = {}
        for node, per in layout.items():
            spec = ((per or {}).get("gres") or {}).get(self.gres_name) or {}
            if spec.get("indexes") is not None:
                gres_by_node[node] = parse_index_list(str(spec["indexes"]))
        tag = read_admin_comment(j.admin_comment)
        state = normalise_state(j.state)
        array_id = j.array_id if j.array_id and j.array_task_id is not None else None
        return Job(
            job_id=int(j.id), name=j.name or "", user=j.user_name or str(j.user_id or ""),
            account=j.account or "", partition=j.partition or "", state=state, reason=_null(j.state_reason),
            nodelist=j.allocated_nodes or "", nodes=_expand_nodes(j.allocated_nodes or ""),
            restarts=int(j.requeue_count or 0), admin_comment=j.admin_comment or "", comment=j.comment or "",
            antman_class=tag.job_class, gpus_by_node=_physical_gpus(tag, gres_by_node),
            tres_per_node=_tres_text(j.gres_per_node), submit_time=_time(j.submit_time),
            start_time=_time(j.start_time) if state != "PENDING" else None,
            excluded_nodes=_expand_nodes(j.excluded_nodes or ""), raw={}, tag_reading=tag,
            array_job_id=int(array_id) if array_id else None,
            array_task=str(j.array_task_id) if array_id else None,
        )

    def jobs(self, states: Optional[Iterable[str]] = None, users: Optional[Iterable[str]] = None) -> list[Job]:
        loaded = self._rpc("Jobs.load", self._pyslurm.Jobs.load)
        jobs = [self._job(j) for j in loaded.values()]
        return filter_jobs(jobs, states, users) if states is not None or users is not None else jobs

    def job(self, job_id: int | str) -> Job:
        ref = self._job_arg(job_id)
        if not ref.isdigit():  # an array task by ARRAY_TASK: the library takes raw ids only
            return super().job(job_id)
        return self._job(self._rpc("Job.load", lambda: self._pyslurm.Job.load(int(ref)), job_id=job_id))

    # nodes() stays the CLI's: pyslurm 25.11.2's Nodes.load leaves allocated_gres empty (checked on a
    # 25.11.7 cluster with every GPU of a node allocated), and the nodes' used GRES is what `antman nodes`
    # shows; a backend that answered differently would not be the same adapter.


def long_lived_backend(env: Optional[Mapping[str, str]] = None, gres_name: str = "gpu",
                       timeout: float = DEFAULT_TIMEOUT_S, choice: str = "auto") -> CliBackend:
    """The backend for a long-lived reader (the coordinator), by antman.yaml's ``slurm.backend``: ``cli``;
    ``pyslurm`` (SlurmError, naming why, where it cannot be used); ``auto``: pyslurm where it was built for
    the running Slurm, else the CLI."""
    cli = CliBackend(env=env, timeout=timeout, gres_name=gres_name)
    if choice == "cli":
        return cli
    try:
        why_not = available(cli.version())
    except SlurmError as e:
        why_not = f"the running Slurm's version is unknown ({e.message})"
    if not why_not:
        return PyslurmBackend(env=env, timeout=timeout, gres_name=gres_name)
    if choice == "pyslurm":
        raise SlurmError(f"slurm.backend is pyslurm, but {why_not}")
    return cli
