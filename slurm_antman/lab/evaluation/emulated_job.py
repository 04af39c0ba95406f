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

With ``--contend`` the formula is not used: the job runs on its GPUs' contending devices
(``contended_gpu``), which execute one job's kernels at a time, in submission order, with a
context-switch cost, so its slowdown is the time it waits for the device behind its neighbours. A
mini-batch is then a host phase of ``iter_ms * (1 - sm_util)`` (data loading: a sleep, the device
left to the others), then a GPU phase of ``iter_ms * sm_util`` launched as kernels of at most
``KERNEL_MAX_S`` without waiting for each (each launch a module call, as :class:`_Kernel` is, for the
launch-mode throttle), then a synchronize (``loss.item()``). ``sm_util`` is nvidia-smi's busy fraction
of the model alone (docs/workload_model.md), so alone the device is busy exactly that fraction of the
job's time (``contended_gpu.split_minibatch``). The record's ``mean_slowdown`` is then measured: the
mini-batch's time, less the throttle's idle, over ``iter_ms``. The formula stays the default (the
replay's comparisons with the simulator depend on it); all jobs of one replay must use the same mode.

The compute is ``time.sleep``: dozens of these jobs share two cores, so they must not burn CPU.
Progress is counted in solo work seconds (``iter_ms`` per mini-batch, whatever it took), saved to a
checkpoint by the preemption hook, every ~10 s and on SIGTERM, and resumed by a requeued run. Every
run appends one record line to ``STATE_DIR/<job_id>.runs.jsonl`` for the replay's report.

With slot filling (``sidecar.slot_filling``, docs/protocol.md "The idle-slot page") the agent publishes
on, or fills from, the idle-slot page the sidecar names; the record's ``slots`` says what it did
(:class:`SlotLog`): the role it was given, how many pages it opened, whether one was still open at the
end, the gates' launches, waits, blind and forced launches, and the busy periods it published.

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

from .contended_gpu import DEFAULT_SWITCH_S, ContendedDevice, DeviceError, Sleeper, minibatch, split_minibatch
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
    p.add_argument("--contend", action="store_true",
                   help="run on the GPUs' contending emulated devices (contended_gpu): the slowdown is "
                        "the time spent waiting for the device, not the workload formula's")
    p.add_argument("--switch-ms", type=float, default=DEFAULT_SWITCH_S * 1e3,
                   help="with --contend: the device's context-switch cost in ms, if this job starts the "
                        "device (default %(default)s, assumed: see contended_gpu)")
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
    if not (math.isfinite(a.switch_ms) and 0 <= a.switch_ms <= 1000):
        p.error(f"--switch-ms must be in [0, 1000] (milliseconds), got {a.switch_ms}")
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


def _launch_class() -> type:
    import torch

    class _Launch(torch.nn.Module):
        """One kernel launch on the contending device (``--contend``): a module call, so that the
        agent's launch-mode throttle hooks it as it hooks a real model's launches. Returns at once
        unless the job's launch queue is full (``ContendedDevice``)."""

        def __init__(self, dev: ContendedDevice) -> None:
            super().__init__()
            self.dev = dev

        def forward(self, seconds: float) -> None:
            self.dev.launch(seconds)
            return None

    return _Launch


class SlotLog:
    """What the agent did with idle-slot pages (torch_patch/slots.py), for the run record. The agent
    opens and closes its publisher or gate only at a boundary (with the limits it applies there), so
    looking after every ``torch_patch.step()`` sees each one it had; a page that went away (the
    guaranteed job ended) takes its gate with it, so the counts are summed over all of them."""

    def __init__(self) -> None:
        self.publishers: list[Any] = []
        self.gates: list[Any] = []

    def look(self, agent: Any) -> None:
        for seen, now in ((self.publishers, getattr(agent, "slot_publisher", None)),
                          (self.gates, getattr(agent, "slot_gate", None))):
            if now is not None and all(x is not now for x in seen):
                seen.append(now)

    def record(self, agent: Any) -> dict:
        if agent is not None:
            self.look(agent)
        open_now = None
        if agent is not None and getattr(agent, "slot_publisher", None) is not None:
            open_now = "publish"
        elif agent is not None and getattr(agent, "slot_gate", None) is not None:
            open_now = "fill"
        g = self.gates
        return {
            "role": "publish" if self.publishers else "fill" if g else None,
            "pages": len(self.publishers) + len(g),  # pages opened (a new file is opened afresh)
            "paths": sorted({x.path for x in (*self.publishers, *g)}),
            "open_at_end": open_now,                 # the page still in use when the job ended
            "launches": sum(x.launches for x in g),
            "waited_s": sum(x.waited_s for x in g),
            "blind": sum(x.blind for x in g),        # launches the page said nothing about
            "forced": sum(x.forced for x in g),      # launches after the longest wait for a slot
            "periods": sum(x.writer.periods for x in self.publishers),  # busy periods published
        }


class EmulatedJob:
    def __init__(self, profile: Profile, work_s: float, state_dir: str, board: Board, ident: Identity,
                 spill_rate: float = DEFAULT_SPILL_RATE, iter_scale: float = 1.0,
                 gpu_mem_bytes: Optional[int] = None, contend: bool = False,
                 switch_s: float = DEFAULT_SWITCH_S) -> None:
        self.profile = profile
        self.contend = contend
        self.switch_s = switch_s
        self.device: Optional[ContendedDevice] = None
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
        self.agent: Any = None
        self.slots = SlotLog()

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
            "contend": self.contend,  # mean_slowdown measured on the contending device, not the formula
            "rank": int(os.environ.get("SLURM_PROCID", "0") or 0),
            "slots": self.slots.record(self.agent),  # before uninstall, which closes the page
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

            agent = self.agent = torch_patch.install()
            agent.emulate_device(self.profile.mem_bytes, self.profile.sm_util)
            torch_patch.on_preempt(lambda notice: self.save_checkpoint())
            self._arrive()
            if self.contend:
                # After the memory check: a job that does not fit never computes.
                self.device = ContendedDevice(self.board.root, self.ident.node, self.ident.gpus,
                                              self.ident.job_id, switch_s=self.switch_s)
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
        except DeviceError as e:
            sys.stderr.write(f"emulated_job: the contending emulated GPU failed: {e}\n")
            return EXIT_FAILED
        finally:
            # From here on a SIGTERM is only noted: the record is what the replay is measured by,
            # and a job that completed stays completed.
            self.guard.hold_forever()
            if self.device is not None:
                self.device.close()  # the device drops whatever of ours is still queued
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

        dev = self.device
        kernel = _kernel_class()() if dev is None else _launch_class()(dev)
        if dev is not None:
            self._throttle_synchronizes(agent.throttle, dev)
        host_sleep = Sleeper()
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
            if dev is None:
                slowdown = self.board.slowdown(job_id, self.profile)
            self._check_memory()
            limit = agent.memory.limit_bytes
            rate = self.spill_rate if limit is not None and limit < footprint else 1.0
            if dev is None:
                busy = self.iter_s * slowdown / rate
                n = max(1, math.ceil(busy / KERNEL_MAX_S))
                for _ in range(n):
                    kernel(busy / n)
            else:
                # Spilled, both phases stretch: the job runs at ``rate`` of its speed, as above.
                gpu_s, host_s = split_minibatch(self.iter_s / rate, util)
                idle0, t0 = agent.throttle.idle_s, time.perf_counter()
                minibatch(dev, gpu_s, host_s, KERNEL_MAX_S, launch=kernel, sleep=host_sleep)
                took = time.perf_counter() - t0 - (agent.throttle.idle_s - idle0)
                slowdown = took * rate / self.iter_s
            with self.guard.held():
                torch_patch.step()  # the boundary: limits applied, throttle idle paid, report sent
                self.slots.look(agent)
                self.work_done_s += self.iter_s
                self._slowdown_sum += slowdown
                self._iterations += 1
                if time.monotonic() - last_ckpt >= CHECKPOINT_EVERY_S:
                    self.save_checkpoint()
                    last_ckpt = time.monotonic()

    @staticmethod
    def _throttle_synchronizes(throttle: Any, dev: ContendedDevice) -> None:
        """The agent's throttle drains the device before it idles (on CUDA it is given
        ``torch.cuda.synchronize``), so that its idle time really leaves the device to the others; an
        emulated agent has no CUDA, and the contending device's synchronize is the equivalent."""
        if throttle.synchronize is None:
            throttle.set_synchronize(dev.synchronize)


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
                      spill_rate=args.spill_rate, iter_scale=args.iter_scale, gpu_mem_bytes=args.gpu_mem_bytes,
                      contend=args.contend, switch_s=args.switch_ms / 1e3)
    job.guard.install()
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
