"""An emulated training job for trace replays (``antman bench trace``) on the devcluster.

Each trace job becomes a real sbatch job that runs this module. It speaks the real agent protocol
through the real torch_patch agent, so the sidecar and the coordinator cannot tell it from a PyTorch
job, and it behaves like the simulator's workload model (``workloads.Profile``, ``simulator.interference``),
so a replay and a simulation of the same trace can be compared:

- a mini-batch takes ``iter_ms * slowdown``, the workload model's measured interference of the other
  jobs on the same emulated GPU at their compute shares, read from the GPU's board (``emulated_gpu``);
- the compute share is enforced by the agent's real throttle, which adds idle time at the
  "kernel launches" (see :class:`_Kernel`) and at the ``torch_patch.step()`` boundary;
- under a memory limit below the footprint the job spills and runs at ``spill_rate`` of that speed;
- with ``--gpu-mem-bytes`` (the ``shared`` policy: nobody limits memory) it fails as PyTorch does when
  the footprints on one of its GPUs exceed that and it arrived there last (``emulated_gpu.oom_decision``):
  "CUDA out of memory" on stderr, a run record with ``"oom": true``, exit 1;
- the agent reports the footprint as GPU memory and ``sm_util`` x duty as GPU busy time
  (``Agent.emulate_device``), which is what the sidecar's emulated telemetry adds up.

The compute is ``time.sleep``: dozens of these jobs share two cores, so they must not burn CPU.
Progress is counted in solo work seconds (``iter_ms`` per mini-batch, whatever it took), saved to a
checkpoint by the preemption hook, every ~10 s and on SIGTERM, and resumed by a requeued run. Every
run appends one record line to ``STATE_DIR/<job_id>.runs.jsonl`` for the replay's report.

Exit status: 0 done, 143 terminated (SIGTERM: Slurm's cancel or requeue), 2 bad arguments or
environment, 1 out of GPU memory (as an uncaught ``RuntimeError`` in PyTorch) or any other failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from slurm_antman.protocol import ENV_CLASS, ENV_CUDA_VISIBLE_DEVICES, ENV_GPUS

from .emulated_gpu import OOM, WAIT, Board, BoardError, OomCheck, write_json_atomic
from .workloads import BY_NAME, Profile

DEFAULT_SPILL_RATE = 0.5  # simulator.interference.SPILL_RATE; not imported so the job does not load the simulator
CHECKPOINT_EVERY_S = 10.0
PUBLISH_EVERY_S = 1.0
# The longest sleep between two "kernel launches": the throttle pays at most 1 s of idle per hook, so
# at the local policy's lowest share (0.05) a launch must not carry more than ~50 ms of busy time.
KERNEL_MAX_S = 0.05
# While a job that may not fit waits for its neighbours to prove they are alive (oom_decision's WAIT):
# how often it looks again. A live neighbour refreshes about once a second.
ARRIVAL_POLL_S = 0.05
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TERMINATED = 0, 1, 2, 143


class UsageError(ValueError):
    """A bad flag or environment variable: exit 2 with this message."""


class OutOfMemory(RuntimeError):
    """The emulated GPU is full and this job came last: what ``torch.cuda.OutOfMemoryError`` (a
    RuntimeError) would end a real job with."""


@dataclass(frozen=True)
class Identity:
    job_id: str
    node: str
    gpus: tuple[int, ...]
    restart_count: int
    job_class: Optional[str]


def identity_from_env(env: Optional[dict] = None) -> Identity:
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id.isdigit() or len(job_id) > 10:
        raise UsageError(f"SLURM_JOB_ID={job_id!r}: required, a Slurm job id (1 to 10 digits); "
                         "run this under sbatch/srun or set it")
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    gpus_raw, gpus_var = "0", "default"
    for var in (ENV_GPUS, ENV_CUDA_VISIBLE_DEVICES):
        if env.get(var):
            gpus_raw, gpus_var = env[var], var
            break
    try:
        gpus = tuple(int(g) for g in gpus_raw.split(","))
        if any(g < 0 for g in gpus):
            raise ValueError
    except ValueError:
        raise UsageError(f"{gpus_var}={gpus_raw!r}: expected a comma list of GPU indices, e.g. 0 or 0,1") from None
    rc_raw = env.get("SLURM_RESTART_COUNT") or "0"
    if not rc_raw.isdigit():
        raise UsageError(f"SLURM_RESTART_COUNT={rc_raw!r}: expected an integer >= 0")
    return Identity(job_id, node, gpus, int(rc_raw), env.get(ENV_CLASS))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m slurm_antman.lab.evaluation.emulated_job",
        description="An emulated training job for trace replays: sleeps like a profile of the "
                    "workload model under the real torch_patch agent.")
    p.add_argument("--profile", required=True, help="workload profile: " + ", ".join(BY_NAME))
    p.add_argument("--work-s", type=float, required=True,
                   help="solo work to do, seconds (the trace job's run time)")
    p.add_argument("--state-dir", required=True, help="checkpoints and run records")
    p.add_argument("--board-dir", required=True, help="the emulated GPUs' shared board")
    p.add_argument("--spill-rate", type=float, default=DEFAULT_SPILL_RATE,
                   help="speed while spilled to host memory, in (0, 1] (default %(default)s)")
    p.add_argument("--iter-scale", type=float, default=1.0,
                   help="mini-batch time multiplier, > 0 (default %(default)s)")
    p.add_argument("--gpu-mem-bytes", type=int, default=None,
                   help="each GPU's memory in bytes: fail with CUDA out of memory when the jobs' "
                        "footprints on a GPU exceed it and this job arrived last (uncontrolled "
                        "sharing); absent: never")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The validated arguments; exits 2 with a message naming the flag otherwise."""
    p = _parser()
    a = p.parse_args(argv)
    if a.profile not in BY_NAME:
        p.error(f"--profile {a.profile!r} is not a workload profile; allowed: {', '.join(BY_NAME)}")
    if not (math.isfinite(a.work_s) and a.work_s > 0):
        p.error(f"--work-s must be a number > 0 (seconds of solo work), got {a.work_s}")
    if not (math.isfinite(a.spill_rate) and 0 < a.spill_rate <= 1):
        p.error(f"--spill-rate must be in (0, 1], got {a.spill_rate}")
    if not (math.isfinite(a.iter_scale) and a.iter_scale > 0):
        p.error(f"--iter-scale must be a number > 0, got {a.iter_scale}")
    if a.gpu_mem_bytes is not None and a.gpu_mem_bytes < 1:
        p.error(f"--gpu-mem-bytes must be an integer >= 1 (bytes of GPU memory), got {a.gpu_mem_bytes}")
    for flag, path in (("--state-dir", a.state_dir), ("--board-dir", a.board_dir)):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            p.error(f"{flag} {path!r}: cannot create the directory: {e.strerror}")
        if not os.access(path, os.W_OK | os.X_OK):
            p.error(f"{flag} {path!r}: the directory is not writable")
    return a


# --- SIGTERM ------------------------------------------------------------------------------------

class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM (BaseException: no ``except Exception`` swallows it)."""


class _TermGuard:
    """SIGTERM ends the run, but never in the middle of the agent's boundary (its socket I/O) or a
    checkpoint write: there it is held until the section ends."""

    def __init__(self) -> None:
        self.requested = False
        self._depth = 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self._depth == 0:
            raise _Terminated()

    def hold_forever(self) -> None:
        self._depth += 1

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self.requested and self._depth == 0:
            raise _Terminated()


def _kernel_class() -> type:
    import torch

    class _Kernel(torch.nn.Module):
        """One emulated kernel launch: a sleep, called as a module so that the agent's launch-mode
        throttle (global module hooks) spreads its idle time between launches as in a real model.
        Oversleeping is carried over, so the busy time adds up to what the model asks for."""

        def __init__(self) -> None:
            super().__init__()
            self.owed = 0.0  # negative: overslept

        def forward(self, seconds: float) -> None:
            self.owed += seconds
            if self.owed > 0:
                t = time.perf_counter()
                time.sleep(self.owed)
                self.owed -= time.perf_counter() - t
            return None

    return _Kernel


class EmulatedJob:
    def __init__(self, profile: Profile, work_s: float, state_dir: str, board: Board, ident: Identity,
                 spill_rate: float = DEFAULT_SPILL_RATE, iter_scale: float = 1.0,
                 gpu_mem_bytes: Optional[int] = None) -> None:
        self.profile = profile
        self.gpu_mem_bytes = gpu_mem_bytes  # None: never out of memory
        self.work_s = work_s
        self.state_dir = state_dir
        self.board = board
        self.ident = ident
        self.spill_rate = spill_rate
        self.iter_s = profile.iter_ms / 1000.0 * iter_scale
        self.ckpt_path = os.path.join(state_dir, f"{ident.job_id}.ckpt")
        self.runs_path = os.path.join(state_dir, f"{ident.job_id}.runs.jsonl")
        self.work_done_s = 0.0
        self.resumed_from_s = 0.0
        self.start_unix = time.time()
        self._slowdown_sum = 0.0
        self._iterations = 0
        self._ckpt_lock = threading.Lock()  # the preemption hook may run on the agent's thread
        self.guard = _TermGuard()

    # --- state --------------------------------------------------------------------------------

    def load_checkpoint(self) -> None:
        try:
            with open(self.ckpt_path) as f:
                d = json.load(f)
            done = float(d["work_done_s"])
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError) as e:
            # A checkpoint we cannot read would silently restart the job from zero; say so.
            sys.stderr.write(f"emulated_job: ignoring unreadable checkpoint {self.ckpt_path}: {e}\n")
            return
        if math.isfinite(done) and done > 0:
            self.work_done_s = self.resumed_from_s = done

    def save_checkpoint(self) -> None:
        with self._ckpt_lock:
            write_json_atomic(self.ckpt_path, {"work_done_s": self.work_done_s,
                                               "restarts": self.ident.restart_count})

    def write_record(self, completed: bool, oom: bool = False) -> None:
        rec = {
            "job_id": self.ident.job_id,
            "start_unix": self.start_unix,
            "end_unix": time.time(),
            "restart_count": self.ident.restart_count,
            "work_done_s": self.work_done_s,
            "resumed_from_s": self.resumed_from_s,
            "completed": completed,
            "oom": oom,  # failed with CUDA out of memory: the replay resubmits the job
            "profile": self.profile.name,
            "node": self.ident.node,
            "gpus": list(self.ident.gpus),
            "mean_slowdown": self._slowdown_sum / self._iterations if self._iterations else 1.0,
            "iterations": self._iterations,
            "class": os.environ.get(ENV_CLASS),
            "rank": int(os.environ.get("SLURM_PROCID", "0") or 0),
        }
        # One write() of one line with O_APPEND: lines of concurrent writers (there are none per job
        # id, but a stray duplicate run must not corrupt the file) do not interleave.
        line = (json.dumps(rec) + "\n").encode()
        fd = os.open(self.runs_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs until the work is done (0), SIGTERM (143) or out of GPU memory (1). Writes the record
        in every case."""
        completed = oom = False
        agent = None
        loaded = False
        try:
            self.load_checkpoint()
            # Only now may the checkpoint be rewritten: a requeued run terminated before it had read
            # it must not overwrite the progress with zero.
            loaded = True
            import torch_patch

            agent = torch_patch.install()
            agent.emulate_device(self.profile.mem_bytes, self.profile.sm_util)
            torch_patch.on_preempt(lambda notice: self.save_checkpoint())
            self._arrive()
            self._loop(agent)
            completed = True
            return EXIT_OK
        except OutOfMemory as e:
            oom = True
            # PyTorch's last line for an uncaught OOM; the Slurm output file is where users look.
            sys.stderr.write(f"RuntimeError: {e}\n")
            return EXIT_FAILED
        except _Terminated:
            return EXIT_TERMINATED
        finally:
            # From here on a SIGTERM is only noted: the record is what the replay is measured by,
            # and a job that completed stays completed.
            self.guard.hold_forever()
            try:
                self.board.withdraw(self.ident.job_id)
            finally:
                if loaded:
                    self.save_checkpoint()
                self.write_record(completed, oom)
                if agent is not None:
                    # The sidecar learns at once (bye) instead of after missed heartbeats.
                    import torch_patch

                    torch_patch.uninstall()

    def _arrive(self) -> None:
        """Allocates: the footprint goes on the board (no load yet: nothing computes while the model
        is being allocated), then, with a GPU memory size, the job fails here if it does not fit and
        came last. It waits while the answer hangs on neighbours that have not refreshed since it
        arrived; they do within about a second or go stale, so the wait is at most ``stale_s``."""
        with self.guard.held():
            self.board.publish(self.ident.job_id, 0.0, self.profile.mem_bytes)
        if self.gpu_mem_bytes is None:
            return
        deadline = time.monotonic() + self.board.stale_s + 1.0
        while True:
            check = self.board.oom_check(self.ident.job_id, self.profile.mem_bytes, self.gpu_mem_bytes, fresh=True)
            if check.decision != WAIT or time.monotonic() > deadline:
                break  # (past the deadline: start, the loop's own check still watches)
            # No refresh meanwhile: a later arrival must see this entry as undecided and wait for it.
            time.sleep(ARRIVAL_POLL_S)
        self._raise_if_oom(check)

    def _check_memory(self) -> None:
        """The same decision during the run, from the board read the slowdown uses. It fires only if
        two jobs started so close together that neither saw the other when it arrived."""
        if self.gpu_mem_bytes is not None:
            self._raise_if_oom(self.board.oom_check(self.ident.job_id, self.profile.mem_bytes, self.gpu_mem_bytes))

    def _raise_if_oom(self, check: OomCheck) -> None:
        if check.decision == OOM:
            raise OutOfMemory(oom_message(self.profile.mem_bytes, check.gpu, self.gpu_mem_bytes, check.others_bytes))

    def _loop(self, agent: Any) -> None:
        import torch_patch

        kernel = _kernel_class()()
        job_id, footprint, util = self.ident.job_id, self.profile.mem_bytes, self.profile.sm_util
        published_share: Optional[float] = None
        last_publish = last_ckpt = time.monotonic()
        while self.work_done_s < self.work_s:
            share = agent.throttle.share
            now = time.monotonic()
            if share != published_share or now - last_publish >= PUBLISH_EVERY_S:
                with self.guard.held():
                    self.board.publish(job_id, util * share, footprint, self.profile.kind, share)
                published_share, last_publish = share, now
            slowdown = self.board.slowdown(job_id, self.profile)
            self._check_memory()
            limit = agent.memory.limit_bytes
            busy = self.iter_s * slowdown
            if limit is not None and limit < footprint:
                busy /= self.spill_rate
            n = max(1, math.ceil(busy / KERNEL_MAX_S))
            for _ in range(n):
                kernel(busy / n)
            with self.guard.held():
                torch_patch.step()  # the boundary: limits applied, throttle idle paid, report sent
                self.work_done_s += self.iter_s
                self._slowdown_sum += slowdown
                self._iterations += 1
                if time.monotonic() - last_ckpt >= CHECKPOINT_EVERY_S:
                    self.save_checkpoint()
                    last_ckpt = time.monotonic()


def oom_message(want: int, gpu: Optional[int], capacity: int, others: int) -> str:
    """PyTorch's wording, with the numbers of the emulated GPU."""
    gib = float(1 << 30)
    return (f"CUDA out of memory. Tried to allocate {want / gib:.2f} GiB (GPU {gpu}; "
            f"{capacity / gib:.2f} GiB total capacity; {others / gib:.2f} GiB already allocated by "
            f"other processes; {max(0, capacity - others) / gib:.2f} GiB free) [emulated: slurm_antman "
            "trace replay, uncontrolled sharing]")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)  # exits 2
    try:
        ident = identity_from_env()
    except UsageError as e:
        sys.stderr.write(f"emulated_job: {e}\n")
        return EXIT_USAGE
    try:
        board = Board(args.board_dir, ident.node, ident.gpus)
    except BoardError as e:
        # The node name becomes a directory of the board.
        sys.stderr.write(f"emulated_job: SLURMD_NODENAME (or the host name): {e}\n")
        return EXIT_USAGE
    job = EmulatedJob(BY_NAME[args.profile], args.work_s, args.state_dir, board, ident,
                      spill_rate=args.spill_rate, iter_scale=args.iter_scale, gpu_mem_bytes=args.gpu_mem_bytes)
    job.guard.install()
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
