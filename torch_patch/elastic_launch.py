"""The elastic launcher: torchrun on one node, restarted over a new GPU list on a width change.

    python -m torch_patch.elastic_launch [--width N] [--stop-timeout S] [--standby-after S | --no-standby]
                                         [--] [torchrun options] SCRIPT [ARGS]

It runs ``python -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=W --max-restarts=0
[torchrun options] SCRIPT [ARGS]`` (through ``torch_patch._torchrun``, which keeps the agent out of
torchrun's own process and refuses the options the launcher owns), with ``CUDA_VISIBLE_DEVICES``
(and ``ANTMAN_GPUS``) set to the job's GPU list and W its length. The list comes from
``CUDA_VISIBLE_DEVICES``, else ``ANTMAN_GPUS``; on a node without GPUs, where neither is set, W is
``--width`` or MAX of ``ANTMAN_ELASTIC=MIN:MAX`` and ``CUDA_VISIBLE_DEVICES`` is left alone.

A width change. The agent of local rank 0 (torch_patch/agent.py) gets ``width`` from the sidecar,
saves the job's checkpoint, answers ``width_done`` and sends this launcher one datagram,
``{"seq": N, "gpus": [...]}``, on the Unix datagram socket it finds in ``ANTMAN_LAUNCHER_SOCKET``.
The launcher then stops torchrun (SIGTERM: torchrun stops its workers; SIGKILL to torchrun and every
process under it after ``--stop-timeout`` seconds), and starts it again with the new list. Every
worker starts afresh and must load the checkpoint. Each change is logged on stderr, as one line
``antman-elastic-launch: width change {JSON}`` with ``gone_s`` (datagram to the old workers gone) and
``started_s`` (datagram to the new torchrun started).

The standby. Starting torchrun means importing torch, about a second of the training gap. So a few
seconds after each start (``--standby-after``, default 3) the launcher starts the next torchrun
ahead of time, which imports torch and waits on its stdin; a width change hands it the width and GPU
list instead of starting one. It holds the memory of an imported torch on the host (no GPU: torch
does not touch CUDA on import). ``--no-standby`` turns it off.

Datagrams are checked strictly: at most 4096 bytes, a JSON object with exactly ``seq`` (an integer
above every seq taken before) and ``gpus`` (1 to 64 distinct integers, 0-1023); anything else is
logged and ignored, and the job goes on. Who may send: the socket lies in a directory of mode 0700
made for it (``tempfile.mkdtemp`` under ``$TMPDIR``, or ``/tmp`` when that path is too long for a
socket), so only the job's user (and root) can reach it; on Linux the launcher also reads the
sender's credentials (SO_PASSCRED) and drops a datagram from any other uid.

``--max-restarts=0``: a width change is the launcher's restart, not torchrun's. With restarts,
torchrun would restart a failed worker group at the same width behind the launcher's and the
sidecar's backs (new agents, new pids, no checkpoint hook run), and a job that keeps failing would
hold its GPUs for every retry. A failed worker ends the job with its exit status; Slurm's requeue
is the way back.

Signals. SIGTERM and SIGINT (Slurm's preemption, scancel, Ctrl-C) are passed to torchrun, which
passes them to its workers; SIGUSR1 (``--signal``) is passed to torchrun, which passes it to the
workers without stopping. torchrun runs in a session of its own, so a signal to the launcher's
process group reaches the job once, through the launcher. (Slurm's proctrack/cgroup signals every
process of the step itself: then a worker gets the signal twice.) A SIGTERM or SIGINT during a width
change ends the job instead of restarting it.

Exit: torchrun's status when it ends on its own (0, or the first failed worker's), 128 + the signal
when it was ended by one. The directory is removed at exit.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Optional

from slurm_antman import protocol as P

from ._torchrun import (PROG, PR_SET_CHILD_SUBREAPER, UsageError, child_pids, descendants, die_with_parent, prctl,
                        say_as)

MAX_DATAGRAM = 4096
MAX_GPU_INDEX = 1023
DEFAULT_STOP_TIMEOUT_S = 30.0
# A standby torchrun (torch imported, waiting for the go) is started this long after each start, so
# that its import does not compete with the workers' own at start-up (--standby-after).
STANDBY_AFTER_S = 3.0
SOCKET_NAME = "launcher.sock"
_SUN_PATH_MAX = 107
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_ENDING = (signal.SIGTERM, signal.SIGINT)
_GPU_ENTRY = re.compile(r"^(?:[0-9]+|(?:GPU|MIG)-[A-Za-z0-9/_.-]+)$")

USAGE = f"""usage: python -m torch_patch.elastic_launch [--width N] [--stop-timeout S] [--standby-after S | --no-standby]
                                             [--] [torchrun options] SCRIPT [ARGS]

Runs SCRIPT under torchrun on this node, one worker per GPU of CUDA_VISIBLE_DEVICES (else
{P.ENV_GPUS}), and restarts every worker over a new GPU list when slurm-antman changes the job's
width (docs/elastic.md).

  --width N         workers when no GPU list is set (a CPU-only node); default: MAX of {P.ENV_ELASTIC}
  --stop-timeout S  seconds torchrun gets to stop its workers before they are killed (default {DEFAULT_STOP_TIMEOUT_S:g})
  --standby-after S seconds after each start to start the next torchrun ahead of a width change (default {STANDBY_AFTER_S:g})
  --no-standby      do not keep a torchrun imported ahead of a width change
  --                ends the launcher's options; everything after goes to torchrun

torchrun's --standalone, --nnodes, --nproc-per-node, rendezvous and --max-restarts are the launcher's.
"""


def say(msg: str) -> None:
    say_as(PROG, msg)


class BadDatagram(ValueError):
    pass


# --- arguments and the first GPU list ---------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[Optional[int], float, Optional[float], list[str]]:
    """The launcher's own options (leading only): (width, stop timeout, standby after (None: no
    standby), what goes to torchrun)."""
    width: Optional[int] = None
    stop_timeout = DEFAULT_STOP_TIMEOUT_S
    standby: Optional[float] = STANDBY_AFTER_S
    rest = list(argv)
    while rest:
        a = rest[0]
        if a == "--":
            rest.pop(0)
            break
        if a in ("-h", "--help"):
            raise UsageError("")
        if a == "--no-standby":
            rest.pop(0)
            standby = None
            continue
        name, eq, value = a.partition("=")
        if name not in ("--width", "--stop-timeout", "--standby-after"):
            break
        rest.pop(0)
        if not eq:
            if not rest:
                raise UsageError(f"{name} needs a value")
            value = rest.pop(0)
        if name == "--width":
            if not re.fullmatch(r"[0-9]{1,2}", value) or not 1 <= int(value) <= P.MAX_JOB_GPUS:
                raise UsageError(f"--width={value!r}: expected an integer from 1 to {P.MAX_JOB_GPUS}")
            width = int(value)
        else:
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if not 0.0 <= seconds <= 3600.0 or (seconds == 0.0 and name == "--stop-timeout"):
                raise UsageError(f"{name}={value!r}: expected seconds in {'(' if name == '--stop-timeout' else '['}0, 3600]")
            if name == "--stop-timeout":
                stop_timeout = seconds
            else:
                standby = seconds
    if not rest:
        raise UsageError("no training script given")
    return width, stop_timeout, standby, rest


def visible_names(env: dict, visible: Optional[list[str]]) -> dict[int, str]:
    """Physical GPU index (``width.gpus``) -> the job's CUDA name for it: under ``ConstrainDevices=yes``
    the Prolog numbers the job's GPUs 0..n-1 in ``CUDA_VISIBLE_DEVICES``, the physical ones alike in
    ``ANTMAN_GPUS``. Without ``ANTMAN_GPUS`` (no slurm-antman Prolog) the names are the indices."""
    if visible is None:
        return {}
    physical = [e.strip() for e in (env.get(P.ENV_GPUS) or "").split(",") if e.strip()]
    if len(physical) == len(visible) and all(_GPU_ENTRY.match(e) and e.isdigit() for e in physical):
        return {int(g): v for g, v in zip(physical, visible)}
    return {int(v): v for v in visible if v.isdigit()}


def initial_gpus(env: dict, width: Optional[int]) -> tuple[Optional[list[str]], int]:
    """(the GPU list or None, the width)."""
    for name in (P.ENV_CUDA_VISIBLE_DEVICES, P.ENV_GPUS):
        raw = (env.get(name) or "").strip()
        if not raw:
            continue
        entries = [e.strip() for e in raw.split(",")]
        if all(_GPU_ENTRY.match(e) for e in entries) and len(set(entries)) == len(entries) \
                and len(entries) <= P.MAX_JOB_GPUS:
            if width is not None and width != len(entries):
                say(f"--width {width} ignored: {name}={raw} names {len(entries)} GPUs")
            return entries, len(entries)
        say(f"{name}={raw!r} is not a GPU list; ignored")
    if width is not None:
        return None, width
    m = re.fullmatch(r"([0-9]{1,2}):([0-9]{1,2})", (env.get(P.ENV_ELASTIC) or "").strip())
    if m and 1 <= int(m.group(1)) <= int(m.group(2)) <= P.MAX_JOB_GPUS:
        return None, int(m.group(2))
    raise UsageError(f"no GPU list ({P.ENV_CUDA_VISIBLE_DEVICES}, {P.ENV_GPUS}) and no --width "
                     f"(or {P.ENV_ELASTIC}=MIN:MAX): how many workers?")


# --- the socket ---------------------------------------------------------------------------------


def parse_datagram(data: bytes) -> tuple[int, list[int]]:
    """``{"seq": N, "gpus": [...]}`` or BadDatagram."""
    if len(data) > MAX_DATAGRAM:
        raise BadDatagram(f"{len(data)} bytes, over {MAX_DATAGRAM}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadDatagram(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"seq", "gpus"}:
        raise BadDatagram("expected an object with exactly seq and gpus")
    seq, gpus = doc["seq"], doc["gpus"]
    if type(seq) is not int or not 1 <= seq < 2 ** 63:
        raise BadDatagram(f"seq {seq!r}: expected an integer >= 1")
    if not isinstance(gpus, list) or not 1 <= len(gpus) <= P.MAX_JOB_GPUS:
        raise BadDatagram(f"gpus: expected a list of 1 to {P.MAX_JOB_GPUS} indices")
    if any(type(g) is not int or not 0 <= g <= MAX_GPU_INDEX for g in gpus):
        raise BadDatagram(f"gpus {gpus!r}: expected integers 0-{MAX_GPU_INDEX}")
    if len(set(gpus)) != len(gpus):
        raise BadDatagram(f"gpus {gpus!r}: an index is listed twice")
    return seq, gpus


_UCRED = struct.Struct("iII")  # pid, uid, gid
_PASSCRED = getattr(socket, "SO_PASSCRED", None)
_SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", None)


def make_socket() -> tuple[str, socket.socket]:
    """(the private directory, the bound datagram socket)."""
    base = tempfile.gettempdir()
    if len(os.path.join(base, "antman-elastic-XXXXXXXX", SOCKET_NAME)) > _SUN_PATH_MAX:
        base = "/tmp"
    d = tempfile.mkdtemp(prefix="antman-elastic-", dir=base)  # mode 0700
    os.chmod(d, 0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(os.path.join(d, SOCKET_NAME))
        if _PASSCRED is not None:
            sock.setsockopt(socket.SOL_SOCKET, _PASSCRED, 1)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        shutil.rmtree(d, ignore_errors=True)
        raise
    return d, sock


def receive(sock: socket.socket) -> list[tuple[int, list[int]]]:
    """Every datagram waiting; the valid ones from this uid, in order of arrival."""
    got = []
    while True:
        try:
            if _PASSCRED is not None:
                data, anc, flags, _ = sock.recvmsg(MAX_DATAGRAM + 1, socket.CMSG_SPACE(_UCRED.size))
            else:
                data, anc, flags = sock.recv(MAX_DATAGRAM + 1), [], 0
        except (BlockingIOError, InterruptedError):
            return got
        if _PASSCRED is not None:
            uid = None
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == _SCM_CREDENTIALS and len(payload) >= _UCRED.size:
                    _, uid, _ = _UCRED.unpack(payload[:_UCRED.size])
            if uid != os.getuid():
                say(f"ignoring a datagram from uid {uid} (only uid {os.getuid()} may change the width)")
                continue
        if flags & getattr(socket, "MSG_TRUNC", 0) or len(data) > MAX_DATAGRAM:
            say(f"ignoring a datagram over {MAX_DATAGRAM} bytes")
            continue
        try:
            got.append(parse_datagram(data))
        except BadDatagram as e:
            say(f"ignoring a bad datagram: {e}")
    return got


# --- processes -------------------------------------------------------------------------------------







class Launcher:
    def __init__(self, torchrun_args: list[str], gpus: Optional[list[str]], width: int, stop_timeout: float,
                 standby_after: Optional[float] = STANDBY_AFTER_S, env: Optional[dict] = None) -> None:
        self.args = torchrun_args
        self.gpus = gpus
        self.width = width
        self.env = dict(os.environ if env is None else env)
        self.names = visible_names(self.env, gpus)  # physical index -> CUDA_VISIBLE_DEVICES name
        self.physical = list(self.names)  # in the job's order: the Nth worker's GPU is the Nth
        self.stop_timeout = stop_timeout
        self.standby_after = standby_after
        self.standby: Optional[subprocess.Popen] = None
        self._standby_due: Optional[float] = None
        self.last_seq = 0
        self.proc: Optional[subprocess.Popen] = None
        self.dir: Optional[str] = None
        self.sock: Optional[socket.socket] = None
        self.ending: Optional[int] = None  # the signal that ends the job (SIGTERM/SIGINT received)
        self._signals: list[int] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # --- signals ---

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for s in (*_FORWARDED, signal.SIGCHLD):
            signal.signal(s, self._on_signal)

    def _reap_orphans(self) -> None:
        """Zombies of processes reparented to the launcher (the subreaper), other than its own two."""
        ours = {p.pid for p in (self.proc, self.standby) if p is not None}
        for pid in child_pids(os.getpid()):
            if pid not in ours:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def _take_signals(self, forward: bool) -> None:
        while self._signals:
            s = self._signals.pop(0)
            if s == signal.SIGCHLD:
                self._reap_orphans()
                continue
            if s in _ENDING and self.ending is None:
                self.ending = s
            if forward and self.proc is not None and self.proc.poll() is None:
                say(f"passing {signal.Signals(s).name} to torchrun")
                try:
                    os.kill(self.proc.pid, s)
                except OSError:
                    pass
            elif not forward:
                say(f"{signal.Signals(s).name} during a width change: "
                    + ("the job ends" if s in _ENDING else "dropped"))

    def _wait_wake(self, timeout: float, datagrams: bool = True) -> list:
        """Sleeps until a signal (SIGCHLD included), a datagram (if ``datagrams``) or the timeout."""
        fds = [self._wake_r, *([self.sock] if datagrams and self.sock is not None else [])]
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            ready = []
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        return ready

    # --- torchrun ---

    def _gpu_env(self) -> dict:
        if self.gpus is None:
            return {}
        physical = ",".join(map(str, self.physical)) if self.physical else ",".join(self.gpus)
        return {P.ENV_CUDA_VISIBLE_DEVICES: ",".join(self.gpus), P.ENV_GPUS: physical}

    def _spawn(self, first: str, env_over: dict) -> subprocess.Popen:
        env = dict(self.env)
        env[P.ENV_LAUNCHER_SOCKET] = os.path.join(self.dir, SOCKET_NAME)  # type: ignore[arg-type]
        env.update(env_over)
        cmd = [sys.executable, "-m", "torch_patch._torchrun", first, *self.args]
        parent = os.getpid()
        return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE if first == "--antman-standby" else subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: die_with_parent(parent))

    def _start(self) -> bool:
        """Starts torchrun over self.gpus; True when the standby took it."""
        standby, self.standby = self.standby, None
        self._standby_due = None if self.standby_after is None else time.monotonic() + self.standby_after
        if standby is not None and standby.poll() is None:
            go = {"width": self.width, "env": self._gpu_env()}
            try:
                standby.stdin.write(json.dumps(go).encode() + b"\n")  # type: ignore[union-attr]
                standby.stdin.close()  # type: ignore[union-attr]
                self.proc = standby
                return True
            except OSError as e:
                say(f"the standby torchrun is gone ({e}); starting one")
                self._drop_standby(standby)
        elif standby is not None:
            self._drop_standby(standby)
        self.proc = self._spawn(f"--antman-width={self.width}", self._gpu_env())
        return False

    def _spawn_standby(self) -> None:
        self._standby_due = None
        if self.ending is None and (self.standby is None or self.standby.poll() is not None):
            if self.standby is not None:
                self._drop_standby(self.standby)
            # The GPU variables as the launcher got them: the go line sets the list of the day.
            self.standby = self._spawn("--antman-standby", {})

    @staticmethod
    def _drop_standby(p: subprocess.Popen) -> None:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
        p.wait()
        if p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass

    def _stop(self) -> None:
        """SIGTERM to torchrun; after stop_timeout SIGKILL to it and everything under it. Returns once
        torchrun and every process it left behind are gone."""
        proc = self.proc
        assert proc is not None
        tree = descendants(proc.pid)
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except OSError:
            pass
        deadline = time.monotonic() + self.stop_timeout
        while proc.poll() is None and time.monotonic() < deadline:
            self._wait_wake(0.05, datagrams=False)  # those wait their turn in the socket
            self._take_signals(forward=False)
        if proc.poll() is None:
            tree = descendants(proc.pid) or tree
            say(f"torchrun did not stop within {self.stop_timeout:g} s: killing it and its {len(tree)} processes")
            for pid in [proc.pid, *tree]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()
        self._reap_leftovers(kill_after=0.0)

    def _reap_leftovers(self, kill_after: float) -> None:
        """Processes left under the launcher (workers torchrun did not stop, reparented to us as the
        subreaper): SIGTERM, then SIGKILL after ``kill_after`` seconds; reaped."""
        mine = os.getpid()
        spare = {self.standby.pid} if self.standby is not None else set()

        def under_us() -> list[int]:
            return [p for p in descendants(mine) if p not in spare]

        left = under_us()
        if not left:
            return
        say(f"{len(left)} processes outlived torchrun: stopping them")
        sig = signal.SIGTERM if kill_after > 0 else signal.SIGKILL
        deadline = time.monotonic() + kill_after
        while left:
            for pid in left:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            for pid in child_pids(mine):
                if pid in spare:
                    continue
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            time.sleep(0.02)
            left = under_us()
            if time.monotonic() >= deadline:
                sig = signal.SIGKILL

    def _change(self, seq: int, gpus: list[int], t0: float) -> None:
        before, width_before = self.gpus, self.width
        if self.names and any(g not in self.names for g in gpus):
            # Only the GPUs it started with are in its device cgroup: it goes on at its width.
            say(f"width change seq {seq} to GPUs {gpus} ignored: the job started on GPUs {sorted(self.names)}")
            self.last_seq = seq
            return
        self._stop()
        gone = time.perf_counter() - t0
        self.last_seq = seq
        self.gpus = [self.names[g] for g in gpus] if self.names else [str(g) for g in gpus]
        self.physical = list(gpus)
        self.width = len(gpus)
        if self.ending is not None:
            say(f"width change seq {seq} not carried out: {signal.Signals(self.ending).name} ends the job")
            return
        warm = self._start()
        started = time.perf_counter() - t0
        say("width change " + json.dumps({
            "seq": seq, "gpus_from": before, "gpus_to": self.gpus, "width_from": width_before,
            "width_to": self.width, "gone_s": round(gone, 4), "started_s": round(started, 4), "standby": warm},
            separators=(",", ":")))

    # --- main loop ---

    def run(self) -> int:
        self._install_signals()
        if sys.platform.startswith("linux"):
            prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.dir, self.sock = make_socket()
        try:
            say(f"socket {os.path.join(self.dir, SOCKET_NAME)}; width {self.width}"
                + (f", GPUs {','.join(self.gpus)}" if self.gpus is not None else ""))
            self._start()
            while True:
                self._take_signals(forward=True)
                assert self.proc is not None
                if self.proc.poll() is not None:
                    break
                wait_s = 1.0
                if self._standby_due is not None:
                    wait_s = max(0.0, min(wait_s, self._standby_due - time.monotonic()))
                    if wait_s == 0.0:
                        self._spawn_standby()
                        wait_s = 1.0
                ready = self._wait_wake(wait_s)
                if self.sock in ready:
                    t0 = time.perf_counter()
                    newest = None
                    for seq, gpus in receive(self.sock):
                        if seq <= self.last_seq or (newest is not None and seq <= newest[0]):
                            say(f"ignoring width seq {seq}: seq {max(self.last_seq, newest[0] if newest else 0)} "
                                "is newer")
                        else:
                            newest = (seq, gpus)
                    if newest is not None:
                        if self.ending is not None:
                            say(f"ignoring width seq {newest[0]}: the job is ending")
                        else:
                            self._change(newest[0], newest[1], t0)
                            if self.ending is not None:
                                return 128 + self.ending
            code = self.proc.returncode
            if self.standby is not None:
                self._drop_standby(self.standby)
                self.standby = None
            self._reap_leftovers(kill_after=5.0)
            return code if code >= 0 else 128 - code
        finally:
            if self.standby is not None:
                self._drop_standby(self.standby)
            if self.proc is not None and self.proc.poll() is None:
                self._stop()
            self.sock.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass


def main(argv: Optional[list[str]] = None) -> int:
    from .elastic_nodes import across_nodes  # an array's task may be one node of a training across nodes
    if (code := across_nodes(argv := sys.argv[1:] if argv is None else argv, parse_args, initial_gpus)) is not None:
        return code
    try:
        width, stop_timeout, standby, rest = parse_args(argv)
        gpus, width = initial_gpus(dict(os.environ), width)
    except UsageError as e:
        if str(e):
            sys.stderr.write(f"{PROG}: {e}\n{USAGE}")
            return 2
        sys.stdout.write(USAGE)
        return 0
    return Launcher(rest, gpus, width, stop_timeout, standby).run()


if __name__ == "__main__":
    sys.exit(main())
