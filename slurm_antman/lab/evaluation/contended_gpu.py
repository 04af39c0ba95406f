"""An emulated GPU that really contends: one small device server per emulated GPU, which executes one
job's kernels at a time, in submission order, without preemption, and charges a context-switch cost
whenever the next kernel belongs to another job than the last one.

``emulated_gpu``'s board makes two emulated jobs on one GPU slow each other by a number read from the
workload formula (``Profile.slowdown``): the devcluster replay could only repeat the simulator's model
of interference. Here interference *emerges* from the jobs' timing: a job whose kernels queue behind a
neighbour's waits, and how long depends on when both have work, which is what the formula models.

**The device.** A process per GPU, on a Unix socket in the board's directory of that GPU,
``ROOT/<node>/<gpu>/.device.sock`` (dot files: the board's readers skip them). It is started on demand
by the first job that finds none (``ContendedDevice`` spawns ``python -m ...contended_device serve``, which
daemonises), and an ``flock`` on ``.device.lock`` held for its whole life makes sure only one runs per
GPU: a second one started by a concurrent job waits briefly for the lock and exits. It exits when no job
has been connected for ``idle_s``. It logs to ``.device.log``. Its core (``contended_device.DeviceCore``) is a FIFO of
kernels over all connections:

- a kernel is a duration; the device "executes" it by sleeping in ``select`` until it is due (CPU-cheap:
  dozens of jobs share two cores here, so nothing spins), then answers ``d <seq> <start_ns> <end_ns>``
  (``time.monotonic_ns``, the same clock in every process of the machine);
- time is kept *virtually*: a kernel queued behind another starts when that one was due to end, not when
  the server woke up to notice, so a late wake-up on a loaded machine delays the notification, never the
  device (its busy time adds up exactly);
- non-preemptive: a running kernel always runs to its end; kernels are at most ``MAX_KERNEL_S`` long;
- ``switch_s`` is charged before a kernel whose owner (connection) differs from the previous kernel's,
  also after an idle gap (the other context must be loaded again), never for the first kernel and never
  between two kernels of one job.

**The switch cost** (``DEFAULT_SWITCH_S`` = 0.1 ms) is **assumed**. NVIDIA does not publish how long
a time-slice switch between CUDA contexts takes ("Detailed context switching mechanics and parametrics
are not published or specified by NVIDIA", forums.developer.nvidia.com/t/multi-process-context-switching/188437),
and no measurement of it was found (PipeSwitch, OSDI'20, measures switching whole models between
processes, 3.6-6.6 ms of start-up, which is loading the model, not a time slice). For scale: a
preemptive switch saves and restores every SM's on-chip state; on a V100 that is 80 SMs x (256 KiB of
registers + up to 96 KiB of shared memory) = 27.5 MiB each way, ~64 us at its 900 GB/s (NVIDIA's Volta
whitepaper figures). This device switches only at kernel boundaries, where less state is live, so
0.1 ms is at the high end; either way it is small against ~50 ms kernels: the device is, to within
a fraction of a percent, a pure time slicer.

**The protocol** (one ASCII line per message, at most ``LINE_MAX`` bytes):

- job -> device: ``hello <name>`` first (``<name>``: a board name, e.g. the job id), then
  ``k <seq> <microseconds> <launch_ns>`` per kernel launch (``seq``: the job's own counter, echoed
  back; ``launch_ns``: ``time.monotonic_ns()`` at the launch). The kernels the device reads in one
  wake-up are queued in the order of their launch times, not in the order it happens to read the
  jobs' sockets, so "submission order" holds across jobs however late the device wakes; a launch time
  counts as at most 1 s before the device read it, never after;
- device -> job: ``ok <version> <switch_us> <pid>`` for the hello, ``d <seq> <start_ns> <end_ns>`` per
  kernel done, in the job's launch order; ``err <reason>`` for a malformed or refused request, after
  which the device closes that connection (it is logged; the device serves on).
- A closed connection (the job exited or was killed) drops that job's queued kernels at once; a kernel
  of it already running finishes (non-preemptive), at most ``MAX_KERNEL_S`` later.
- A job that does not read its completions is dropped (its socket buffer full: at most
  ``MAX_QUEUED`` short lines, which a reading client never reaches).

**The job side** (:class:`ContendedDevice`) models CUDA's asynchrony: ``launch`` returns at once while
fewer than ``inflight`` of the job's kernels are unfinished (CUDA's launch queue) and blocks for the
oldest otherwise; ``synchronize`` waits for all (``loss.item()``, ``torch.cuda.synchronize()``). A job on
several GPUs sends every kernel to each of them and waits for all (its step waits for its slowest GPU).
If its device goes away (the Slurm job that started it ended and took it along, or it was killed), the
job starts or finds another one and sends its unfinished kernels again.

A mixed GPU, where some jobs contend here and others take the formula's slowdown from the board, is not
meaningful: a replay runs all its emulated jobs in one mode.
"""

from __future__ import annotations

import collections
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional, Sequence

from .emulated_gpu import BoardError, _check_name

PROTOCOL_VERSION = 1
SOCK_NAME, LOCK_NAME, LOG_NAME = ".device.sock", ".device.lock", ".device.log"
DEFAULT_SWITCH_S = 0.0001     # assumed (module doc)
DEFAULT_INFLIGHT = 4          # kernels a job may have unfinished before a launch blocks (class doc)
DEFAULT_IDLE_S = 60.0         # the device exits after this long with no job connected
MAX_KERNEL_S = 1.0            # the longest kernel the device accepts (a killed job frees it within this)
MAX_QUEUED = 1024             # unfinished kernels per job
MAX_CLIENTS = 256
LINE_MAX = 160
LOCK_WAIT_S = 2.0             # a second device started for the same GPU waits this long for the lock
START_TIMEOUT_S = 15.0        # a job gives up finding or starting its device after this long
RESPAWN_S = 2.0               # ... and starts another one if the one it started does not answer
HANDSHAKE_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 120.0        # no completion for this long: the device is taken as gone
MAX_RECOVERIES = 20
# The device sleeps the last this-many seconds before a kernel is due without select (see run).
_PRECISE_S = 0.0015
# Unix socket paths are limited to 108 bytes; a longer board path is reached through /proc/self/fd.
_SUN_PATH_MAX = 100

_HELLO_RE = re.compile(rb"hello ([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})")
_KERNEL_RE = re.compile(rb"k (\d{1,18}) (\d{1,10}) (\d{1,20})")
_MAX_LAUNCH_AGE_S = 1.0
_DONE_RE = re.compile(rb"d (\d{1,18}) (\d{1,20}) (\d{1,20})")
_OK_RE = re.compile(rb"ok (\d+) (\d+) (\d+)")


class DeviceError(RuntimeError):
    """The device could not be reached or refused a request."""


def gpu_dir(root: str, node: str, gpu: int) -> str:
    """``ROOT/<node>/<gpu>``, the board's directory of one GPU, checked as the board checks it."""
    _check_name("node", node)
    if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
        raise BoardError(f"gpu {gpu!r}: a GPU index (an integer >= 0)")
    return os.path.join(root, node, str(gpu))


# --- addresses and locks ----------------------------------------------------------------------------


class _Address:
    """The device socket's address for bind/connect: the path itself, or, when the board's path is too
    long for a Unix socket, the same file through an ``O_PATH`` descriptor of its directory."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, SOCK_NAME)
        self._fd: Optional[int] = None
        if len(os.fsencode(self.path)) <= _SUN_PATH_MAX:
            self.addr = self.path
        else:
            self._fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            self.addr = f"/proc/self/fd/{self._fd}/{SOCK_NAME}"

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "_Address":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- the job's side ---------------------------------------------------------------------------------


def _package_root() -> str:
    import slurm_antman

    return os.path.dirname(os.path.dirname(os.path.abspath(slurm_antman.__file__)))


def spawn_device(root: str, node: str, gpu: int, switch_s: float, idle_s: float) -> None:
    """Starts a device for the GPU in the background (it daemonises; the lock keeps it one per GPU)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "slurm_antman.lab.evaluation.contended_device", "serve", "--daemon",
           "--root", root, "--node", node, "--gpu", str(gpu), "--switch-ms", repr(switch_s * 1e3),
           "--idle-s", repr(idle_s)]
    subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=env, close_fds=True, start_new_session=True, timeout=30, check=False)


class _Link:
    """One job's connection to one GPU's device."""

    def __init__(self, root: str, node: str, gpu: int, name: str, switch_s: float, idle_s: float,
                 start_timeout_s: float) -> None:
        self.root, self.node, self.gpu, self.name = root, node, gpu, name
        self.dir = gpu_dir(root, node, gpu)
        self.switch_s, self.idle_s, self.start_timeout_s = switch_s, idle_s, start_timeout_s
        self.sock: Optional[socket.socket] = None
        self.buf = bytearray()
        # seq -> (us, launch_ns), in launch order
        self.outstanding: "collections.OrderedDict[int, tuple[int, int]]" = collections.OrderedDict()
        self.seq = 0
        self.recoveries = 0
        self.server_pid: Optional[int] = None
        self.server_switch_us: Optional[int] = None
        self.last_done: Optional[tuple[int, int, int]] = None  # (seq, start_ns, end_ns)
        os.makedirs(self.dir, exist_ok=True)
        self._connect()

    def _try_connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(HANDSHAKE_TIMEOUT_S)
            with _Address(self.dir) as a:
                s.connect(a.addr)
            s.sendall(b"hello %s\n" % self.name.encode())
            buf = bytearray()
            while b"\n" not in buf:
                chunk = s.recv(256)
                if not chunk:
                    raise ConnectionResetError("the device closed the connection during the hello")
                buf += chunk
                if len(buf) > LINE_MAX:
                    raise DeviceError(f"device at {self.dir}: an overlong answer to hello")
            line, _, rest = bytes(buf).partition(b"\n")
            m = _OK_RE.fullmatch(line)
            if m is None:
                raise DeviceError(f"device at {self.dir} refused the hello: {line.decode('ascii', 'replace')}")
            if int(m.group(1)) != PROTOCOL_VERSION:
                raise DeviceError(f"device at {self.dir} speaks protocol {m.group(1).decode()}, this job "
                                  f"{PROTOCOL_VERSION}")
            self.server_switch_us, self.server_pid = int(m.group(2)), int(m.group(3))
            s.settimeout(READ_TIMEOUT_S)
            self.buf = bytearray(rest)
            return s
        except BaseException:
            s.close()
            raise

    def _connect(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        next_spawn = 0.0
        delay = 0.005
        while True:
            try:
                self.sock = self._try_connect()
                return
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError,
                    socket.timeout) as e:
                now = time.monotonic()
                if now >= deadline:
                    raise DeviceError(f"no emulated GPU device at {self.dir} within {self.start_timeout_s:g} s "
                                      f"({e}); its log: {os.path.join(self.dir, LOG_NAME)}") from None
                if now >= next_spawn:
                    spawn_device(self.root, self.node, self.gpu, self.switch_s, self.idle_s)
                    next_spawn = time.monotonic() + RESPAWN_S
                time.sleep(delay)
                delay = min(0.1, delay * 2)

    def _recover(self, why: str) -> None:
        """The device went away: find or start another and send the unfinished kernels again."""
        self.recoveries += 1
        if self.recoveries > MAX_RECOVERIES:
            raise DeviceError(f"device at {self.dir} lost {self.recoveries} times ({why}); giving up")
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._connect()
        if self.outstanding:
            self._send(b"".join(b"k %d %d %d\n" % (seq, us, t) for seq, (us, t) in self.outstanding.items()))

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)  # type: ignore[union-attr]
        except (BrokenPipeError, ConnectionResetError, socket.timeout) as e:
            self._recover(f"send: {e}")  # resends everything unfinished, this too

    def launch(self, us: int, inflight: int) -> None:
        while len(self.outstanding) >= inflight:
            self._wait_one()
        seq = self.seq
        self.seq += 1
        t = time.monotonic_ns()
        self.outstanding[seq] = (us, t)
        self._send(b"k %d %d %d\n" % (seq, us, t))

    def synchronize(self) -> None:
        while self.outstanding:
            self._wait_one()

    def _wait_one(self) -> None:
        try:
            line = self._readline()
        except (ConnectionResetError, BrokenPipeError, EOFError, socket.timeout) as e:
            self._recover(f"read: {e!r}")
            return
        m = _DONE_RE.fullmatch(line)
        if m is None:
            text = line.decode("ascii", "replace")
            if text.startswith("err "):
                raise DeviceError(f"device at {self.dir} refused a request: {text[4:]}")
            raise DeviceError(f"device at {self.dir}: unexpected answer {text[:60]!r}")
        seq = int(m.group(1))
        if self.outstanding.pop(seq, None) is None:
            raise DeviceError(f"device at {self.dir} finished kernel {seq}, which this job has not launched")
        self.last_done = (seq, int(m.group(2)), int(m.group(3)))

    def _readline(self) -> bytes:
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line = bytes(self.buf[:nl])
                del self.buf[:nl + 1]
                return line
            if len(self.buf) > LINE_MAX:
                raise DeviceError(f"device at {self.dir}: an overlong line")
            chunk = self.sock.recv(4096)  # type: ignore[union-attr]
            if not chunk:
                raise EOFError("the device closed the connection")
            self.buf += chunk

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class ContendedDevice:
    """A job's handle on the contending devices of its GPUs (module doc): ``launch`` a kernel of
    ``seconds`` (asynchronous up to ``inflight`` unfinished kernels per GPU), ``synchronize`` to wait
    for all of them. ``inflight`` (default 4) is **assumed**: CUDA's launch queue holds about a thousand
    launches (not documented by NVIDIA), so a real job's whole iteration is usually in flight; an
    emulated kernel here stands for up to ~50 ms of work, and 4 of them hold a whole GPU phase of most
    profiles, while a longer phase blocks at launches as a full CUDA queue does."""

    def __init__(self, root: str, node: str, gpus: Sequence[int], name: str, switch_s: float = DEFAULT_SWITCH_S,
                 inflight: int = DEFAULT_INFLIGHT, idle_s: float = DEFAULT_IDLE_S,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        _check_name("name", name)
        if not (isinstance(inflight, int) and inflight >= 1):
            raise ValueError(f"inflight must be an integer >= 1, got {inflight!r}")
        if not (math.isfinite(switch_s) and 0 <= switch_s <= MAX_KERNEL_S):
            raise ValueError(f"switch_s must be in [0, {MAX_KERNEL_S}], got {switch_s!r}")
        gpus = sorted(set(gpus))
        if not gpus:
            raise ValueError("a device needs at least one GPU")
        self.inflight = inflight
        self.links: list[_Link] = []
        try:
            for g in gpus:
                self.links.append(_Link(root, node, g, name, switch_s, idle_s, start_timeout_s))
        except BaseException:
            self.close()
            raise

    def launch(self, seconds: float) -> None:
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and 0 < seconds <= MAX_KERNEL_S):
            raise ValueError(f"a kernel takes (0, {MAX_KERNEL_S}] seconds, got {seconds!r}")
        us = max(1, round(seconds * 1e6))
        for link in self.links:
            link.launch(us, self.inflight)

    def synchronize(self) -> None:
        for link in self.links:
            link.synchronize()

    @property
    def server_pids(self) -> list[Optional[int]]:
        return [link.server_pid for link in self.links]

    def close(self) -> None:
        for link in self.links:
            link.close()

    def __enter__(self) -> "ContendedDevice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- a mini-batch on the device -----------------------------------------------------------------------


def stop_devices(pids: Iterable[int], root: str) -> None:
    """End the device servers a benchmark started (by the pids they reported) and remove its
    directory."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    time.sleep(0.1)
    shutil.rmtree(root, ignore_errors=True)


def split_minibatch(iter_s: float, sm_util: float) -> tuple[float, float]:
    """(GPU phase, host phase) of a mini-batch of ``iter_s`` for a profile of ``sm_util``.

    ``sm_util`` is nvidia-smi's utilisation of the model alone (docs/workload_model.md, "L"): the
    fraction of the time a kernel was running. So alone, a mini-batch keeps the GPU busy
    ``iter_s * sm_util`` and leaves it idle the rest, ``iter_s * (1 - sm_util)`` (data loading, the
    host's own work): the GPU phase runs on the device, the host phase is a sleep beside it. The
    formula's duty ``b`` is a fraction of that benchmark's GPU work (``Profile.duty``); an emulated job
    runs its benchmark, duty 1. Overlap of host work with the GPU (a data loader's prefetching) is not
    modelled: it is already inside the measured utilisation, which is what the split keeps."""
    gpu = iter_s * sm_util
    return gpu, max(0.0, iter_s - gpu)


class Sleeper:
    """Sleeps that add up: oversleeping is carried over to the next sleep (as ``_Kernel`` does)."""

    def __init__(self) -> None:
        self.owed = 0.0

    def __call__(self, seconds: float) -> None:
        self.owed += seconds
        if self.owed > 0:
            t = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - t


def minibatch(device: ContendedDevice, gpu_s: float, host_s: float, kernel_max_s: float,
              launch: Optional[Callable[[float], None]] = None, sleep: Callable[[float], None] = time.sleep) -> None:
    """One mini-batch: the host phase (the device idle, as far as this job goes), then the GPU phase in
    kernels of at most ``kernel_max_s`` launched without waiting (``launch``, default
    ``device.launch``), then a synchronize, as ``loss.item()`` does."""
    if host_s > 0:
        sleep(host_s)
    if gpu_s > 0:
        n = max(1, math.ceil(gpu_s / kernel_max_s - 1e-9))
        go = launch or device.launch
        for _ in range(n):
            go(gpu_s / n)
        device.synchronize()
