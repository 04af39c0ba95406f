"""The job registry: jobs registered and retired over the control socket (opportunistic ones placed
here), each with its own agent socket, and their records in the state directory, so a restarted
sidecar rebinds them."""

from __future__ import annotations

import logging
import time

import zmq

from slurm_antman import protocol as p
from slurm_antman.policy.node.placement import GpuLoad, choose_gpus

from .endpoints import SocketDir, SocketDirError
from .loop import bound_router
from .records import RegisteredJob

log = logging.getLogger("antman.sidecar")

# Placement memory: a requeued job is back within Slurm's BeginTime (120 s) plus its queue wait; a
# day covers that on a busy cluster and bounds what a sidecar keeps.
AVOID_TTL_S = 86400.0
AVOID_MAX_JOBS = 4096


class JobRegistry:
    """Mixed into ``daemon.Sidecar``, which makes this state."""

    dir: SocketDir
    jobs: dict[str, RegisteredJob]
    avoid: dict[str, tuple[frozenset[int], float]]
    _ctx: zmq.Context
    _poller: zmq.Poller
    _sock_job: dict[zmq.Socket, RegisteredJob]
    placement_waits: int
    state_write_errors: int

    def _restore_saved(self) -> None:
        for rec in self.dir.saved_jobs():
            try:
                self._restore(rec)
            except (KeyError, TypeError, ValueError, SocketDirError, zmq.ZMQError) as e:
                log.warning("could not restore saved job %r: %s", rec.get("job_id"), e)
        if self.jobs:
            log.info("restored %d job(s) from %s: %s", len(self.jobs), self.dir.root, ", ".join(sorted(self.jobs)))

    def _register_job(self, b: p.JobRegister) -> p.JobRegisterReply:
        n = self.telemetry.gpu_count()
        old = self.jobs.get(b.job_id)
        if old is not None and (old.job_class, old.uid, old.gid) == (b.job_class, b.uid, b.gid) and (
                b.physical_gpus is None or sorted(b.physical_gpus) == sorted(old.gpus)):
            # A retried Prolog (or one re-registering after a sidecar restart): same answer.
            return self._register_reply(old)
        if b.job_class == "guaranteed":
            if b.physical_gpus is None:
                raise p.ProtocolError(p.ErrorCode.bad_value,
                                      "job_register.physical_gpus is required for guaranteed jobs (the GPUs Slurm bound)")
            if len(set(b.physical_gpus)) != len(b.physical_gpus) or len(b.physical_gpus) != b.gpus:
                raise p.ProtocolError(p.ErrorCode.bad_value, f"job_register.physical_gpus {b.physical_gpus} must "
                                      f"be {b.gpus} distinct GPU indices (job_register.gpus)")
            bad = [i for i in b.physical_gpus if i >= n]
            if bad:
                raise p.ProtocolError(p.ErrorCode.bad_value, f"job_register.physical_gpus: {bad} out of range; "
                                      f"node {self.opt.node} has GPUs 0-{n - 1}")
            if b.elastic_min is not None:
                raise p.ProtocolError(p.ErrorCode.bad_value, "job_register.elastic_min must be null for guaranteed "
                                      "jobs: a guaranteed job's width is its own (docs/elastic.md)")
            if b.elastic_group is not None:
                raise p.ProtocolError(p.ErrorCode.bad_value, "job_register.elastic_group must be null for "
                                      "guaranteed jobs: Slurm bound their GPUs, the sidecar cannot keep them apart")
            gpus, placement, note = list(b.physical_gpus), "requested", ""
        else:
            if b.physical_gpus is not None:
                raise p.ProtocolError(p.ErrorCode.bad_value, "job_register.physical_gpus must be null for "
                                      "opportunistic jobs: the sidecar chooses their GPUs")
            if b.elastic_min is not None and b.elastic_min > b.gpus:
                raise p.ProtocolError(p.ErrorCode.bad_value, f"job_register.elastic_min {b.elastic_min} is above "
                                      f"the job's width job_register.gpus {b.gpus}")
            if old is not None:
                self._retire_job(old.job_id)
            self._sample(time.time())  # place on fresh numbers, not the last tick's
            avoid, until = self.avoid.pop(b.job_id, (frozenset(), 0.0))
            self._check_health(time.monotonic(), force=True)  # fresh: the Prolog may have just failed to write
            if self.unhealthy and self.opt.no_room_wait and b.may_wait:
                self.placement_waits += 1
                note = f"node {self.opt.node} takes no new opportunistic job: {self.unhealthy}"
                log.info("job %s: %s; the Prolog requeues it", b.job_id, note)
                return p.JobRegisterReply(job_id=b.job_id, gpus=[], endpoint="", placement="wait", note=note[:4096])
            choice = choose_gpus(self._gpu_loads(), b.gpus, self.opt.slots_per_gpu,
                                 self.opt.utilization_threshold, self.opt.utilization_window_s,
                                 self.opt.params.target_slowdown, self.opt.params.min_progress,
                                 avoid if until > time.time() else (),
                                 wait_without_room=self.opt.no_room_wait and b.may_wait,
                                 fill=self.opt.slot_fill if self.opt.slot_filling else 0.0,
                                 apart=self._siblings_gpus(b.job_id, b.elastic_group))
            # In physical order: CUDA numbers the devices a job's cgroup allows that way, and the Prolog's
            # CUDA_VISIBLE_DEVICES (0..n-1 under ConstrainDevices) and ANTMAN_GPUS follow this list, so
            # the Nth worker (local rank N) runs on the Nth GPU here too.
            gpus, placement, note = sorted(choice.gpus), choice.placement, choice.note
            if placement == "fallback":
                log.warning("job %s: fallback placement on GPU(s) %s: %s", b.job_id, gpus, note)
            elif placement == "wait":
                # Not registered: the Prolog requeues the job. Its placement memory outlives the refusal.
                if avoid:
                    self.avoid[b.job_id] = (avoid, until)
                self.placement_waits += 1
                log.info("job %s: no room for %d GPU(s); the Prolog requeues it: %s", b.job_id, b.gpus, note)
                return p.JobRegisterReply(job_id=b.job_id, gpus=[], endpoint="", placement="wait", note=note[:4096])
        if old is not None and b.job_id in self.jobs:
            self._retire_job(old.job_id)
        job = RegisteredJob(b.job_id, b.job_class, b.uid, b.gid, b.user, gpus, placement, note, time.time(),
                  account=b.account or "", elastic_min=b.elastic_min, elastic_gpus=sorted(gpus),
                  elastic_group=b.elastic_group)
        self._open_job(job)
        self._save(job)
        log.info("job %s (%s, uid %d) registered on GPU(s) %s [%s]", job.job_id, job.job_class, job.uid, gpus, placement)
        self._run_policy(time.time())
        return self._register_reply(job)

    def _gpu_loads(self) -> list[GpuLoad]:
        loads = []
        now = time.time()
        for s in self.gpu_samples:
            on = [j for j in self.jobs.values() if s.index in j.gpus]
            loads.append(GpuLoad(s.index, s.memory_total_bytes, s.memory_used_bytes, self.util.average(s.index),
                                 sum(j.job_class == "guaranteed" for j in on),
                                 sum(j.job_class == "opportunistic" for j in on),
                                 self._util_measured(on, now)))
        return loads

    def _siblings_gpus(self, job_id: str, group: str | None) -> frozenset[int]:
        """The GPUs the other tasks of ``group``'s elastic array are placed on here."""
        if group is None:
            return frozenset()
        return frozenset(g for j in self.jobs.values() if j.elastic_group == group and j.job_id != job_id
                         for g in (*j.gpus, *j.elastic_gpus))

    def _save(self, job: RegisteredJob) -> None:
        """Record the job for a restarted sidecar. A full or read-only state directory costs only
        that (a restart would not find the job): the job itself is served and limited as before."""
        try:
            self.dir.save_job(job.job_id, job.record())
        except OSError as e:
            self.state_write_errors += 1
            self._rlog.warning("state-write", "job %s: cannot record it in %s (%s); it is served, but a restarted "
                               "sidecar will not find it", job.job_id, self.dir.root, e)

    def _register_reply(self, job: RegisteredJob) -> p.JobRegisterReply:
        return p.JobRegisterReply(job_id=job.job_id, gpus=list(job.gpus), endpoint=p.ipc(self.dir.agent_path(job.job_id)),
                                  placement=job.placement, note=job.note)

    def _open_job(self, job: RegisteredJob) -> None:
        path = self.dir.make_job_dir(job.job_id, job.uid, job.gid)
        sock = self._ctx.socket(zmq.ROUTER)
        bound_router(sock)
        try:
            sock.bind(p.ipc(path))
            self.dir.secure_agent_socket(job.job_id, job.uid, job.gid)
        except (zmq.ZMQError, OSError, SocketDirError) as e:
            sock.close(0)
            self.dir.remove_job(job.job_id)
            raise SocketDirError(f"cannot bind job {job.job_id}'s endpoint {path}: {e}") from None
        job.socket = sock
        self._sock_job[sock] = job
        self._poller.register(sock, zmq.POLLIN)
        self.jobs[job.job_id] = job

    def _restore(self, rec: dict) -> None:
        job = RegisteredJob(str(rec["job_id"]), rec["job_class"], int(rec["uid"]), rec.get("gid"), str(rec["user"]),
                  [int(g) for g in rec["gpus"]], rec["placement"], rec["note"], float(rec["registered_unix"]),
                  account=str(rec.get("account") or ""))
        if job.job_class not in p.JOB_CLASSES:
            raise ValueError(f"bad class {job.job_class!r}")
        group = rec.get("elastic_group")  # a record from before the field has none
        if group is not None:
            if not isinstance(group, str) or not p.JOB_ID_RE.match(group):
                raise ValueError(f"bad elastic group {group!r}")
            job.elastic_group = group
        if rec.get("elastic_min") is not None:  # a record from before elastic width has none
            job.elastic_min = int(rec["elastic_min"])
            job.elastic_gpus = [int(g) for g in rec.get("elastic_gpus") or job.gpus]
            job.width_seq = int(rec.get("width_seq") or 0)
            if not 1 <= job.elastic_min <= len(job.elastic_gpus) or not set(job.gpus) <= set(job.elastic_gpus):
                raise ValueError(f"bad elastic width {job.elastic_min} over {job.elastic_gpus} (running on {job.gpus})")
        self._open_job(job)

    def _retire_job(self, job_id: str) -> bool:
        job = self.jobs.pop(job_id, None)
        if job is None:
            self.dir.remove_job(job_id)  # an Epilog after a crash may find only the directory
            return False
        if job.socket is not None:
            for a in job.agents.values():
                self._send(job.socket, a, p.Bye(reason="job retired"))
            self._poller.unregister(job.socket)
            self._sock_job.pop(job.socket, None)
            job.socket.close(0)
        self.dir.remove_job(job_id)
        self._lift_caps(job_id)
        log.info("job %s retired", job_id)
        self._run_policy(time.time())
        return True

    def _known(self, job_id: str, what: str) -> RegisteredJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise p.ProtocolError(p.ErrorCode.unknown_job,
                                  f"{what}: job {job_id} is not registered on node {self.opt.node}")
        return job

    def _remember_avoid(self, job_id: str, gpus: list[int], now: float) -> None:
        self.avoid = {k: v for k, v in self.avoid.items() if v[1] > now}
        if len(self.avoid) >= AVOID_MAX_JOBS:
            self.avoid.pop(min(self.avoid, key=lambda k: self.avoid[k][1]))
        self.avoid[job_id] = (frozenset(gpus), now + AVOID_TTL_S)
