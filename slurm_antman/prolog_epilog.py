"""``antman node prolog|epilog``: what slurmd runs, as root, around every job on a node.

The Prolog registers a slurm-antman job with the node's sidecar, which chooses the physical GPUs
of an opportunistic job (Slurm only counted slots of a count-only GRES), and writes the node-local
env file the SPANK plugin applies to every task (docs/architecture.md). It also records the GPUs
in the job's AdminComment so anyone can see them with Slurm's own tools.

An opportunistic job whose tag carries ``elastic=MIN:MAX`` (``--antman-elastic``, docs/elastic.md) gets
``ANTMAN_ELASTIC=MIN:MAX`` in its env file (``jobtag.elastic_kind``): when MAX is the GPU slots it holds on
this node it is registered with ``elastic_min=MIN`` (the sidecar changes its width GPU by GPU); when it
is a task of an elastic job array across nodes (MAX and MIN multiples of its slots here, MAX above them)
it is registered without ``elastic_min``, since its width changes a task at a time, by the requeue that
takes any opportunistic job off a node, and with ``elastic_group`` (its array's job id), so the sidecar
never places two tasks of one training on one GPU. A range that fits neither is ignored (logged): not elastic.

A Prolog that exits non-zero drains the node and requeues the job, so every policy-level problem
is logged and the hook still exits 0. An opportunistic job is never run unmanaged (fail closed):
when no GPU of the node meets the opportunistic rules (``opportunistic.no_room: wait``), when the
sidecar does not answer, or when the hook itself fails, the job's env file says ANTMAN_REFUSED (the
SPANK plugin then fails its tasks) and the hook asks Slurm to requeue it; only when even that fails
does the hook exit non-zero, leaving the requeue to Slurm at the price of a drained node.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path

from . import config as config_mod
from . import device_failure
from . import envfile
from . import protocol as p
from .jobtag import ONE_NODE, JobTag, elastic_kind
from .slurm import Job, SlurmBackend, SlurmError
from .slurm.cli_backend import CliBackend

log = logging.getLogger("antman.node")

# A Prolog holds up the job's start: a controller that does not answer in this long is treated as down.
SLURM_TIMEOUT_S = 15.0


def _slurm(gpu_gres: str = "gpu") -> SlurmBackend:
    return CliBackend(timeout=SLURM_TIMEOUT_S, gres_name=gpu_gres)


_TRES_OPP = r"gres[:/]{name}(?::[^,:]+)?:(\d+)"  # 22.05 gres:NAME:N, 24.11 gres/NAME:N


@dataclass(frozen=True)
class JobContext:
    job_id: str
    node: str
    uid: int
    gid: int | None
    user: str
    spank_class: str | None
    partition: str
    slurm_gpus: list[int]
    account: str = ""
    # What scontrol must be told to act on this job alone: ARRAY_TASK for an array task (whose raw id
    # may be the array's own, which names every task), the raw id otherwise.
    slurm_ref: str = ""

    @property
    def ref(self) -> str:
        return self.slurm_ref or self.job_id

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "JobContext":
        gpus = [int(x) for x in re.findall(r"\d+", env.get("SLURM_JOB_GPUS", ""))]
        return cls(
            job_id=env["SLURM_JOB_ID"],
            node=env.get("SLURMD_NODENAME") or _node_of_job(env["SLURM_JOB_ID"]),
            uid=int(env.get("SLURM_JOB_UID", "0")),
            gid=int(env["SLURM_JOB_GID"]) if env.get("SLURM_JOB_GID", "").isdigit() else None,
            user=env.get("SLURM_JOB_USER", ""),
            spank_class=env.get(p.ENV_SPANK_CLASS) or None,
            partition=env.get("SLURM_JOB_PARTITION", ""),
            slurm_gpus=gpus,
            account=env.get("SLURM_JOB_ACCOUNT", ""),
            slurm_ref=_ref_from_env(env),
        )


    @classmethod
    def from_slurm(cls, env: dict[str, str], gpu_gres: str) -> "JobContext":
        """For the Prolog the SPANK plugin runs inside a job step. The step's environment is the user's,
        so only what the plugin took from slurmstepd itself is used (job id, uid, gid, this node's
        index in the job: ANTMAN_JOB_NODEID); the node, partition, account and GPUs come from slurmctld."""
        job_id = env["SLURM_JOB_ID"]
        job = _slurm(gpu_gres).job(job_id)
        index = env.get(p.ENV_JOB_NODEID, "")
        if index.isdigit() and int(index) < len(job.nodes):
            node = job.nodes[int(index)]
        elif len(job.nodes) == 1:
            node = job.nodes[0]
        else:
            raise RuntimeError(f"job {job_id} runs on {job.nodelist or 'no node'} and the plugin gave no usable "
                               f"node index ({index or 'none'})")
        return cls(
            job_id=job_id, node=node,
            uid=int(env.get("SLURM_JOB_UID", "0")),
            gid=int(env["SLURM_JOB_GID"]) if env.get("SLURM_JOB_GID", "").isdigit() else None,
            user=env.get("SLURM_JOB_USER", ""),
            spank_class=env.get(p.ENV_SPANK_CLASS) or None,
            partition=job.partition,
            slurm_gpus=sorted(job.gpus_by_node.get(node, [])),
            account=job.account,
            slurm_ref=job.slurm_id,
        )


def _ref_from_env(env: dict[str, str]) -> str:
    """ARRAY_TASK from slurmd's Prolog environment (SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID)."""
    aid, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    return f"{aid}_{task}" if aid.isdigit() and task.isdigit() else ""


def _node_of_job(job_id: str) -> str:
    """The node when slurmd did not say: the SPANK plugin runs the Prolog from inside a job step,
    where SLURMD_NODENAME does not exist yet. A one-node job's NodeList is the answer; otherwise
    (or without a controller) the short hostname, which is the node name on a real cluster."""
    try:
        nodes = _slurm().job(job_id).nodelist
        if re.fullmatch(r"[A-Za-z0-9_.-]+", nodes):
            return nodes
        log.warning("job %s: no SLURMD_NODENAME and NodeList %s is not one node; using the hostname",
                    job_id, nodes or "unknown")
    except (SlurmError, ValueError) as e:
        log.warning("job %s: no SLURMD_NODENAME and scontrol failed (%s); using the hostname", job_id, e)
    return os.uname().nodename.split(".")[0]


def _record_gpus_in_slurm(slurm: SlurmBackend, job: JobContext, tag: JobTag) -> None:
    """Merge this node's GPUs into AdminComment. Several nodes of one job may do this at once, so
    read back and retry until our entry is there."""
    from . import hostlist

    for _ in range(3):
        record = slurm.job(job.job_id)
        current = record.checked_tag() or tag
        try:
            nodes = hostlist.expand(record.nodelist) if record.nodelist else [job.node]
        except hostlist.HostlistError:
            nodes = list(current.gpus) + [job.node]
        merged = current.only_on(nodes).with_gpus(job.node, tag.gpus.get(job.node, []))
        try:
            slurm.update(job.ref, AdminComment=merged.render())
        except SlurmError as e:
            log.warning("job %s: cannot record GPUs in AdminComment: %s", job.job_id, e.stderr or e.message)
            return
        check = slurm.job(job.job_id).checked_tag()
        if check and check.gpus.get(job.node) == tag.gpus.get(job.node):
            return
    log.warning("job %s: AdminComment GPU entry for %s kept being overwritten", job.job_id, job.node)


def prolog(cfg: config_mod.AntmanConfig, env: dict[str, str]) -> int:
    s = cfg.slurm
    from_spank = env.get(p.ENV_PROLOG_FROM_SPANK) == "1"
    job = JobContext.from_slurm(env, s.gpu_gres) if from_spank else JobContext.from_env(env)
    # Most jobs on a mixed cluster are plain Slurm jobs: decide that without a controller round trip.
    if (not from_spank and job.spank_class is None and cfg.default_class.value == "none"
            and job.partition != s.opportunistic_partition):
        return 0
    if from_spank and env.get(p.ENV_DEVICE_FAILURE):
        return _device_failure(cfg, job, env[p.ENV_DEVICE_FAILURE])
    if from_spank:
        # slurmd skips the Prolog when a requeued job restarts on a node that still caches its credential.
        log.info("job %s on %s: env file missing at step start; Prolog run by the SPANK plugin", job.job_id, job.node)
    slurm = _slurm(s.gpu_gres)
    record = slurm.job(job.job_id)
    job = replace(job, slurm_ref=record.slurm_id)
    tag = record.checked_tag()
    if tag is None:
        return 0
    group = cfg.node_groups_by_host().get(job.node)
    if group is None:
        log.error("job %s: node %s is not in %s; leaving the job to plain Slurm", job.job_id, job.node, "antman.yaml")
        return 0
    if tag.job_class == "opportunistic":
        m = re.search(_TRES_OPP.format(name=re.escape(s.opportunistic_gres)), record.tres_per_node)
        count = int(m.group(1)) if m else 0
    else:
        count = len(job.slurm_gpus)
    values = {p.ENV_JOB_ID: job.job_id, p.ENV_CLASS: tag.job_class, p.ENV_NODE: job.node}
    if tag.job_class == "opportunistic":
        try:
            elastic_min, elastic_group = _elastic(job, tag, count, values, record)
            return _place_and_record(cfg, slurm, job, tag, count, group.gpus, values, elastic_min, elastic_group)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the job must not run unmanaged
            log.exception("job %s: Prolog failed for an opportunistic job", job.job_id)
            return refuse(cfg, job, values, f"the Prolog failed ({type(e).__name__}: {e})", slurm)
    return _place_and_record(cfg, slurm, job, tag, count, group.gpus, values)


def _elastic(job: JobContext, tag: JobTag, count: int, values: dict[str, str],
             record: Job) -> tuple[int | None, str | None]:
    """An opportunistic job's elastic range (the tag's elastic=MIN:MAX): sets ``ANTMAN_ELASTIC`` in
    ``values`` for an elastic job and returns the ``elastic_min`` and ``elastic_group`` to register.
    A one-node elastic job has the first, a task of an array across nodes the second (its node never
    changes its width; its array's other tasks must not share its GPUs), any other job neither. A range
    that fits neither kind for the job's GPU slots on this node (job_submit.lua refuses such a job; an
    admin may have edited the tag since) is ignored: the job runs at its full width, not elastic."""
    if tag.elastic is None:
        return None, None
    lo, hi = tag.elastic
    kind = elastic_kind(tag.elastic, count)
    if kind is None:
        log.warning("job %s on %s: its tag says elastic=%d:%d but it holds %d GPU slot(s) here; "
                    "not elastic", job.job_id, job.node, lo, hi, count)
        return None, None
    values[p.ENV_ELASTIC] = f"{lo}:{hi}"
    if kind == ONE_NODE:
        return lo, None
    # slurmctld's record, not the environment: slurmd 22.05 gives the Prolog no SLURM_ARRAY_JOB_ID (seen
    # on the devcluster), and where the SPANK plugin runs the Prolog the environment is the user's.
    aid = str(record.array_job_id) if record.array_job_id and record.array_task is not None else ""
    if not p.JOB_ID_RE.match(aid):
        # Placed as any job: nothing then keeps a sibling task off its GPU, but it runs.
        log.warning("job %s on %s: a task of an elastic array across nodes whose record names no array "
                    "(ArrayJobId %r); the sidecar cannot keep its array's other tasks off its GPUs",
                    job.job_id, job.node, record.array_job_id)
        return None, None
    return None, aid


def _opportunistic_gpu_env(cfg: config_mod.AntmanConfig, job: JobContext, gpus: list[int]) -> dict[str, str]:
    """Slurm bound no device for a count-only GRES: this is what makes the job see its GPU(s). Under
    ConstrainDevices the SPANK plugin opens the devices named in ANTMAN_GPU_DEVICES in the job's
    cgroup, and CUDA numbers the GPUs the job can open from 0, as Slurm numbers a guaranteed job's."""
    from .slurm import cgroup_conf

    paths = cfg.node_groups_by_host()[job.node].gpu_device_paths
    devices = []
    for g in gpus:
        if not 0 <= g < len(paths):
            raise RuntimeError(f"the sidecar placed the job on GPU {g}; {job.node} has {len(paths)} device files")
        st = os.stat(paths[g])  # the site's own gres.conf files, as root: never a path the job names
        if not stat.S_ISCHR(st.st_mode):
            raise RuntimeError(f"{paths[g]} (GPU {g} of {job.node}) is not a character device")
        devices.append(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    visible = ",".join(map(str, range(len(gpus)) if cgroup_conf.constrain_devices() else gpus))
    return {p.ENV_CUDA_VISIBLE_DEVICES: visible, "GPU_DEVICE_ORDINAL": visible,
            p.ENV_GPU_DEVICES: ",".join(devices)}


def _place_and_record(cfg: config_mod.AntmanConfig, slurm: SlurmBackend, job: JobContext, tag: JobTag, count: int,
                      n_gpus: int, values: dict[str, str], elastic_min: int | None = None,
                      elastic_group: str | None = None) -> int:
    lock_path = Path(cfg.state_dir) / job.node / ".prolog.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two Prologs must not both see a GPU as free
        try:
            gpus, endpoint = _place(cfg, job, tag.job_class, count, n_gpus, elastic_min, elastic_group)
        except NoRoom as e:
            return refuse(cfg, job, values, str(e), slurm)
        values[p.ENV_GPUS] = ",".join(map(str, gpus))
        if endpoint:
            values[p.ENDPOINT_ENV] = endpoint
        if tag.job_class == "opportunistic":
            values.update(_opportunistic_gpu_env(cfg, job, gpus))
        try:
            envfile.write(envfile.path(cfg.state_dir, job.node, job.job_id), values)
        except OSError:
            # Without its env file the job's tasks would not get what the sidecar set up for them,
            # and the Epilog would not retire it: undo the registration before failing.
            if endpoint:
                _retire_quietly(cfg, job)
            raise
    elastic = values.get(p.ENV_ELASTIC)
    log.info("job %s on %s: class %s, GPUs %s%s", job.job_id, job.node, tag.job_class, values[p.ENV_GPUS] or "-",
             "" if elastic is None else f", elastic {elastic}" + (" across nodes" if elastic_min is None else ""))
    _record_gpus_in_slurm(slurm, job, tag.with_gpus(job.node, gpus))
    return 0


class NoRoom(Exception):
    """The opportunistic job may not start on this node now; the message says why."""


def _device_failure(cfg: config_mod.AntmanConfig, job: JobContext, cause: str) -> int:
    """The SPANK plugin could not grant the job its placed GPU (spank/devices.c) and failed its task: requeue
    it with the plugin's cause, and keep opportunistic jobs off this node for a while (device_failure).
    ``cause`` is the plugin's own text (only the plugin's fixed environment reaches this hook with it)."""
    reason = f"its GPU could not be granted on {job.node}: {cause}"
    try:
        # envfile.path checks the node name: root writes here
        device_failure.record(envfile.path(cfg.state_dir, job.node, job.job_id).parent.parent, job.job_id, cause)
    except (OSError, envfile.EnvFileError) as e:
        log.error("job %s: cannot record the device failure on %s: %s", job.job_id, job.node, e)
    return refuse(cfg, job, {p.ENV_JOB_ID: job.job_id, p.ENV_NODE: job.node}, reason)


# scontrol requeue is retried on these back-offs (s) before the hook gives up and fails.
REQUEUE_BACKOFF_S = (1.0, 3.0)


def refuse(cfg: config_mod.AntmanConfig, job: JobContext, values: dict[str, str], reason: str,
           slurm: SlurmBackend | None = None) -> int:
    """Fail closed for an opportunistic job: its tasks will not start here (ANTMAN_REFUSED in its env
    file) and Slurm requeues it. Returns the hook's exit code."""
    # A NUL would make the plugin skip the ANTMAN_REFUSED line, and the format refuses it: the job must stay refused.
    reason = " ".join(reason.replace("\0", " ").split())[:512] or "no reason given"
    refused = {**values, p.ENV_GPUS: "", p.ENV_CUDA_VISIBLE_DEVICES: "", p.ENV_REFUSED: reason}
    try:
        envfile.write(envfile.path(cfg.state_dir, job.node, job.job_id), refused)
    except OSError as e:
        log.error("job %s: cannot write the refusal into its env file: %s", job.job_id, e)
    slurm = slurm or _slurm(cfg.slurm.gpu_gres)
    for delay in (*REQUEUE_BACKOFF_S, None):
        try:
            slurm.requeue(job.ref)  # an array task alone, never its whole array
        except SlurmError as e:
            err = e.stderr or e.message
        except ValueError as e:  # a reference scontrol would refuse too: the last resort below still holds
            err = str(e)
        else:
            log.warning("job %s on %s: not started, requeued: %s", job.job_id, job.node, reason)
            return 0
        if delay is None:
            break
        time.sleep(delay)
    # Exiting non-zero makes slurmd requeue the job itself (and drain the node): better than a job
    # that runs unmanaged beside a guaranteed one, or one that fails for want of a GPU.
    log.error("job %s on %s: not started (%s) and scontrol requeue failed (%s); failing the Prolog so that "
              "Slurm requeues it", job.job_id, job.node, reason, err)
    return 1


def _place(cfg: config_mod.AntmanConfig, job: JobContext, job_class: str, count: int,
           n_gpus: int, elastic_min: int | None = None,
           elastic_group: str | None = None) -> tuple[list[int], str | None]:
    """The job's GPUs and agent endpoint, from the sidecar. Raises ``NoRoom`` for an opportunistic job
    that must not start (no GPU met the rules, or no sidecar to enforce its limits). ``elastic_min``
    and ``elastic_group`` go to the sidecar only for an elastic job (None otherwise)."""
    from .clients import sidecar_control as client

    physical = job.slurm_gpus if job_class != "opportunistic" else None
    try:
        reply = client.register_job(cfg.node_socket_dir(job.node), job.job_id, uid=job.uid, gid=job.gid,
                                    user=job.user, job_class=job_class, gpus=count, physical_gpus=physical,
                                    timeout_s=5.0, account=job.account, may_wait=physical is None,
                                    elastic_min=elastic_min, elastic_group=elastic_group)
    except (client.SidecarUnreachable, client.SidecarError) as e:
        if physical is None:
            raise NoRoom(f"no sidecar to place and limit it: {e}") from None
        log.warning("job %s: %s; the guaranteed job runs on the GPUs Slurm bound, unmeasured", job.job_id, e)
        return physical, None
    if reply.placement == "wait":
        raise NoRoom(f"no GPU of {job.node} meets the opportunistic rules: {reply.note}")
    if reply.note:
        log.info("job %s: sidecar placement note: %s", job.job_id, reply.note)
    return list(reply.gpus), reply.endpoint


def _retire_quietly(cfg: config_mod.AntmanConfig, job: JobContext) -> None:
    from .clients import sidecar_control as client

    try:
        client.retire_job(cfg.node_socket_dir(job.node), job.job_id, timeout_s=5.0)
    except (client.SidecarUnreachable, client.SidecarError) as e:
        log.warning("job %s: could not retire at the sidecar: %s", job.job_id, e)


def epilog(cfg: config_mod.AntmanConfig, env: dict[str, str]) -> int:
    job = JobContext.from_env(env)
    f = envfile.path(cfg.state_dir, job.node, job.job_id)
    if not f.exists():
        return 0
    _retire_quietly(cfg, job)
    f.unlink(missing_ok=True)
    log.info("job %s on %s: retired", job.job_id, job.node)
    return 0


def _setup_logging(cfg: config_mod.AntmanConfig | None) -> None:
    # slurmd discards a Prolog's output, so the hooks log to a file next to their state.
    target = Path(cfg.state_dir if cfg else "/tmp") / "hooks.log"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(target)
    except OSError:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"))
    logging.getLogger("antman").addHandler(handler)
    logging.getLogger("antman").setLevel(logging.INFO)


def main(hook: str, config_path: str) -> int:
    try:
        cfg = config_mod.load(config_path)
    except config_mod.ConfigError as e:
        _setup_logging(None)
        log.error("%s: %s", hook, e)
        return 0
    _setup_logging(cfg)
    env = dict(os.environ)
    if "SLURM_JOB_ID" not in env:
        log.error("%s run without SLURM_JOB_ID: not called by slurmd?", hook)
        return 2
    try:
        return prolog(cfg, env) if hook == "prolog" else epilog(cfg, env)
    except Exception as e:  # noqa: BLE001 - never drain a node over a slurm-antman bug
        job = JobContext.from_env(env) if hook == "prolog" else None
        if job is not None and (job.partition == cfg.slurm.opportunistic_partition
                                or job.spank_class == "opportunistic"):
            # Before its class was read: the opportunistic partition holds only jobs that must not run unmanaged.
            log.exception("prolog for job %s failed", job.job_id)
            return refuse(cfg, job, {p.ENV_JOB_ID: job.job_id, p.ENV_NODE: job.node},
                          f"the Prolog failed ({type(e).__name__}: {e})")
        log.exception("%s for job %s failed; job left to plain Slurm", hook, env.get("SLURM_JOB_ID"))
        return 0
