"""The elastic launcher across nodes: this node's share of one torchrun training, run as one task of a
Slurm job array (docs/elastic.md, "The launcher across nodes").

    sbatch --antman=opportunistic --antman-elastic=MIN:MAX --array=0-(K-1) --gres=gpu:G train.sh    (MAX = K x G)
    python -m torch_patch.elastic_launch [--node-addr ADDR] [--rdzv-dir DIR] [--max-restarts R]
        [--join-timeout S] [--width N] [--stop-timeout S] [--] [torchrun options] SCRIPT [ARGS]

``torch_patch.elastic_launch`` hands over to this module when ``SLURM_ARRAY_JOB_ID`` is set and MAX of
``ANTMAN_ELASTIC=MIN:MAX`` is above this task's width G (its GPU list, else ``--width``): the array's
tasks are then the nodes of one training, not trainings of their own. A shrink is Slurm requeueing a
task (its torchrun gets SIGTERM), a grow is Slurm starting a pending one; torchrun's elastic rendezvous
does the rest. It runs (through ``torch_patch._torchrun``, as the one-node launcher does)::

    torchrun --nnodes=ceil(MIN/G):MAX/G --nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT
             --rdzv-id=ARRAY_JOB_ID --rdzv-conf=is_host=0|1,join_timeout=S,last_call_timeout=1,
             keep_alive_interval=1,keep_alive_max_attempt=5 --local-addr=ADDR --max-restarts=R
             [torchrun options] SCRIPT [ARGS]

- A node leaving: the others' workers fail, their agents wait until its heartbeat is keep_alive_interval
  x keep_alive_max_attempt old (5 s; torch's default is 15 s), then meet again without it; that costs
  each of them one of ``--max-restarts``. A node joining: the running agents restart their workers to
  admit it, at no cost in restarts. Every restart starts the workers afresh: they load the checkpoint.
- ``last_call_timeout=1``: once MIN nodes are in, the rendezvous waits this long for more (torch's
  default is 30 s). Every shrink pays it, since the survivors are fewer than MAX; a node that comes later
  joins anyway, through the running agents' restart, so waiting longer would only save that restart.
  1 s (it takes whole seconds) still lets tasks that Slurm starts together meet in one round.
- ``--max-restarts`` (default 20): each shrink costs one on every agent that stays, and a script that
  always fails must not hold its nodes forever. A task started later begins with all 20.
- The store: task 0 (``SLURM_ARRAY_TASK_ID`` equal to ``SLURM_ARRAY_TASK_MIN``) hosts the rendezvous's
  c10d store on a free port and publishes it in ``DIR/.antman-rdzv.<ARRAY_JOB_ID>.json`` (``--rdzv-dir``,
  default ``$SLURM_SUBMIT_DIR``): ``{"addr", "port", "job_id", "array_job_id", "restart", "time"}``, written
  atomically (mode 0600, then a rename), removed at exit. The other tasks wait for the file (up to
  ``--join-timeout``, 600 s) and for its endpoint to answer, and check every field. A file that is not
  a regular file of this user, not JSON, or has a field of the wrong type or range, or another array's
  id, is refused with one line. When task 0 goes (requeued, as any task), the others' torchrun fails;
  each waits for task 0's next file and starts again (at most ``--max-restarts`` times).
- ``--node-addr``: the address the other nodes reach this one at (the store's, when task 0, and the
  workers' master address when this node has rank 0). Default: Slurm's NodeAddr of
  ``$SLURMD_NODENAME`` (``scontrol show node``); not the hostname, which may not tell nodes apart.
- The end: when torchrun ends with 0 on task 0 (training done), the array's pending tasks are cancelled
  (``scancel --state=PENDING ARRAY_JOB_ID``), so that none starts later with nobody to train with.
- Each start is logged on stderr, ``antman-elastic-nodes: {JSON}``. Signals and exit statuses are the
  one-node launcher's: SIGTERM, SIGINT and SIGUSR1 go to torchrun (in a session of its own); the exit
  status is torchrun's, or 128 + the signal that ended it. No width changes within the node: the
  workers get no ``ANTMAN_LAUNCHER_SOCKET``, so the sidecar never asks this job's agents for one.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from slurm_antman import protocol as P

from ._torchrun import (PR_SET_CHILD_SUBREAPER, UsageError, child_pids, descendants, die_with_parent, prctl,
                        say_as)
from .elastic_rdzv import Refused, answers, endpoint, free_port, parse_rdzv, rdzv_path, read_rdzv, valid_addr, write_rdzv

PROG = "antman-elastic-nodes"
DEFAULT_MAX_RESTARTS = 20
DEFAULT_JOIN_TIMEOUT_S = 600  # torch's own default join_timeout
LAST_CALL_S = 1
# A node is dead KEEP_ALIVE_S x KEEP_ALIVE_MISSES after its last heartbeat (torch's default: 5 x 3 =
# 15 s), which the survivors wait out at every shrink. Not 3 misses: torch's timer ticks every
# KEEP_ALIVE_S but skips a tick that comes a hair early, so a live node's beats are often 2 s apart.
KEEP_ALIVE_S = 1
KEEP_ALIVE_MISSES = 5
POLL_S = 0.5  # waiting for task 0's file or its store to answer
_MINE = ("--node-addr", "--rdzv-dir", "--max-restarts", "--join-timeout")
_LAUNCHERS = ("--width", "--stop-timeout", "--standby-after")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_ENDING = (signal.SIGTERM, signal.SIGINT)

USAGE = f"""usage: python -m torch_patch.elastic_launch [--node-addr ADDR] [--rdzv-dir DIR] [--max-restarts R]
                                             [--join-timeout S] [--width N] [--stop-timeout S]
                                             [--] [torchrun options] SCRIPT [ARGS]

In a job array whose {P.ENV_ELASTIC} MAX is above one task's GPUs, each task runs this node's share of
one torchrun training across the array's running tasks (docs/elastic.md, "The launcher across nodes").

  --node-addr ADDR  this node's address for the other nodes (default: Slurm's NodeAddr of $SLURMD_NODENAME)
  --rdzv-dir DIR    directory all tasks share, for task 0's rendezvous file (default $SLURM_SUBMIT_DIR)
  --max-restarts R  worker restarts torchrun may make (each node leaving costs one; default {DEFAULT_MAX_RESTARTS})
  --join-timeout S  seconds to wait for task 0's file and for the rendezvous (default {DEFAULT_JOIN_TIMEOUT_S})
  --width N         workers on this node when no GPU list is set (a CPU-only node)
  --stop-timeout S  seconds torchrun gets to stop its workers before they are killed (default 30)
  --standby-after S, --no-standby  accepted and ignored: no width change within a node here
  --                ends the launcher's options; everything after goes to torchrun

torchrun's --nnodes, --nproc-per-node, --standalone, --rdzv-*, --local-addr and --max-restarts are the launcher's.
"""


def say(msg: str) -> None:
    say_as(PROG, msg)


class Ending(Exception):
    """SIGTERM or SIGINT before torchrun ran."""


@dataclass
class Options:
    width: Optional[int]
    stop_timeout: float
    node_addr: Optional[str]
    rdzv_dir: Optional[str]
    max_restarts: int
    join_timeout: int
    rest: list[str]


# --- arguments and the environment -------------------------------------------------------------------


# elastic_launch's parse_args and initial_gpus, passed in: the one-node launcher imports this module.
LauncherArgs = Callable[[list[str]], tuple[Optional[int], float, Optional[float], list[str]]]
InitialGpus = Callable[[dict, Optional[int]], tuple[Optional[list[str]], int]]


def parse_args(argv: list[str], launcher_args: LauncherArgs) -> Options:
    """The launcher's leading options; the one-node launcher's are checked by its parser."""
    theirs: list[str] = []
    mine: dict[str, str] = {}
    rest = list(argv)
    while rest:
        a = rest[0]
        if a == "--":
            break
        if a in ("-h", "--help"):
            raise UsageError("")
        if a == "--no-standby":
            rest.pop(0)
            continue
        name, eq, value = a.partition("=")
        if name not in _MINE and name not in _LAUNCHERS:
            break
        rest.pop(0)
        if not eq:
            if not rest:
                raise UsageError(f"{name} needs a value")
            value = rest.pop(0)
        if name in _MINE:
            mine[name] = value
        else:
            theirs += [name, value]
    if rest and rest[0] == "--":
        rest.pop(0)
    width, stop_timeout, _standby, rest = launcher_args([*theirs, "--", *rest])
    addr = mine.get("--node-addr")
    if addr is not None and not valid_addr(addr):
        raise UsageError(f"--node-addr={addr!r}: expected an IP address or a host name")
    restarts = mine.get("--max-restarts", str(DEFAULT_MAX_RESTARTS))
    if not re.fullmatch(r"[0-9]{1,4}", restarts) or int(restarts) > 1000:
        raise UsageError(f"--max-restarts={restarts!r}: expected an integer from 0 to 1000")
    join = mine.get("--join-timeout", str(DEFAULT_JOIN_TIMEOUT_S))
    # Whole seconds: torch reads its rendezvous timeouts as integers.
    if not re.fullmatch(r"[0-9]{1,5}", join) or not 10 <= int(join) <= 86400:
        raise UsageError(f"--join-timeout={join!r}: expected whole seconds from 10 to 86400")
    return Options(width, stop_timeout, addr, mine.get("--rdzv-dir"), int(restarts), int(join), rest)


def elastic_range(env: dict) -> Optional[tuple[int, int]]:
    m = re.fullmatch(r"([0-9]{1,2}):([0-9]{1,2})", (env.get(P.ENV_ELASTIC) or "").strip())
    if m and 1 <= int(m.group(1)) <= int(m.group(2)) <= P.MAX_JOB_GPUS:
        return int(m.group(1)), int(m.group(2))
    return None


def _env_int(env: dict, name: str, lo: int = 0) -> int:
    raw = env.get(name, "")
    if not re.fullmatch(r"[0-9]{1,10}", raw) or int(raw) < lo:
        raise Refused(f"{name}={raw!r}: expected an integer (is this a Slurm array task?)", 2)
    return int(raw)


def slurm_node_addr(env: dict) -> str:
    """This node's NodeAddr, as Slurm knows it."""
    name = env.get("SLURMD_NODENAME", "")
    hint = "pass --node-addr ADDR, the address the other nodes reach this one at"
    if not P.NODE_NAME_RE.match(name):
        raise Refused(f"SLURMD_NODENAME={name!r} is not a node name: {hint}", 2)
    try:
        r = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True, timeout=30,
                           env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Refused(f"cannot run scontrol for node {name}'s NodeAddr ({e}): {hint}", 2) from None
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", r.stdout)
    if r.returncode != 0 or m is None or not valid_addr(m.group(1)):
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1] if m is None else f"NodeAddr={m.group(1)!r}"
        raise Refused(f"no usable NodeAddr for node {name} from scontrol ({why}): {hint}", 2)
    return m.group(1)


# --- processes (as elastic_launch's) ------------------------------------------------------------------





# --- one task -----------------------------------------------------------------------------------------


class NodeTask:
    def __init__(self, opts: Options, env: dict, gpus: Optional[list[str]], width: int,
                 nodes: tuple[int, int]) -> None:
        self.opts = opts
        self.env = env
        self.gpus = gpus
        self.width = width
        self.nodes = nodes
        self.array_job_id = env["SLURM_ARRAY_JOB_ID"]
        self.job_id = str(_env_int(env, "SLURM_JOB_ID"))
        self.task = _env_int(env, "SLURM_ARRAY_TASK_ID")
        self.host = self.task == _env_int(env, "SLURM_ARRAY_TASK_MIN")
        directory = opts.rdzv_dir or env.get("SLURM_SUBMIT_DIR") or ""
        if not directory or not os.path.isdir(directory):
            raise Refused(f"rendezvous directory {directory!r} is not a directory: pass --rdzv-dir DIR, "
                          "one every task of the array sees", 2)
        self.path = rdzv_path(directory, self.array_job_id)
        self.addr = opts.node_addr or slurm_node_addr(env)
        self.proc: Optional[subprocess.Popen] = None
        self.published: Optional[os.stat_result] = None
        self.ending: Optional[int] = None
        self._signals: list[int] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # --- signals ---

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _take_signals(self) -> None:
        while self._signals:
            s = self._signals.pop(0)
            if s == signal.SIGCHLD:
                continue
            if s in _ENDING and self.ending is None:
                self.ending = s
            if self.proc is not None and self.proc.poll() is None:
                say(f"passing {signal.Signals(s).name} to torchrun")
                try:
                    os.kill(self.proc.pid, s)
                except OSError:
                    pass
        if self.ending is not None and self.proc is None:
            raise Ending()

    def _sleep(self, timeout: float) -> None:
        try:
            select.select([self._wake_r], [], [], timeout)
        except InterruptedError:
            pass
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        self._take_signals()

    # --- the rendezvous endpoint ---

    def _publish(self) -> dict:
        doc = {"addr": self.addr, "port": free_port(), "job_id": self.job_id,
               "array_job_id": self.array_job_id, "restart": _env_int(self.env, "SLURM_RESTART_COUNT")
               if self.env.get("SLURM_RESTART_COUNT") else 0, "time": round(time.time(), 3)}
        parse_rdzv(json.dumps(doc).encode(), self.array_job_id)  # what the others will check
        self.published = write_rdzv(self.path, doc)
        return doc

    def _unpublish(self) -> None:
        """Removes the file if it is still the one this task wrote."""
        if self.published is None:
            return
        try:
            st = os.stat(self.path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (self.published.st_dev, self.published.st_ino):
                os.unlink(self.path)
        except OSError:
            pass
        self.published = None

    def _wait_endpoint(self) -> dict:
        """Task 0's endpoint, once its store answers (a file left by a task 0 that is gone never does)."""
        deadline = time.monotonic() + self.opts.join_timeout
        said = False
        while True:
            doc = read_rdzv(self.path, self.array_job_id)
            if doc is not None and answers(doc["addr"], doc["port"]):
                return doc
            if not said:
                say(f"waiting for task 0's store ({self.path}" + (f", {endpoint(doc)}" if doc else "") + ")")
                said = True
            if time.monotonic() > deadline:
                raise Refused(f"task 0's store did not answer within {self.opts.join_timeout} s "
                              f"(--join-timeout); rendezvous file {self.path}: "
                              + (f"{endpoint(doc)}" if doc else "none"))
            self._sleep(POLL_S)

    def _store_gone(self, used: dict) -> bool:
        try:
            doc = read_rdzv(self.path, self.array_job_id)
        except Refused:
            return True
        return doc != used or not answers(used["addr"], used["port"])

    # --- torchrun ---

    def owned(self, doc: dict) -> list[str]:
        lo, hi = self.nodes
        conf = (f"is_host={int(self.host)},join_timeout={self.opts.join_timeout},last_call_timeout={LAST_CALL_S},"
                f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_MISSES}")
        return [f"--nnodes={lo}:{hi}", f"--nproc-per-node={self.width}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint(doc)}", f"--rdzv-id={self.array_job_id}", f"--rdzv-conf={conf}",
                f"--local-addr={self.addr}", f"--max-restarts={self.opts.max_restarts}"]

    def _spawn(self, owned: list[str]) -> subprocess.Popen:
        env = dict(self.env)
        # No width changes within a node here: without the socket no agent offers them to the sidecar.
        env.pop(P.ENV_LAUNCHER_SOCKET, None)
        if self.gpus is not None:
            env[P.ENV_CUDA_VISIBLE_DEVICES] = ",".join(self.gpus)
        # torch caches the workers' store address from its first rendezvous on a node that is not rank
        # 0 then, and reuses it after the ranks move (a node of a lower address joins, or rank 0 leaves):
        # the workers of two nodes then wait in two stores. Unshared, it is found again every round.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch_patch._torchrun", f"--antman-nodes={len(owned)}", *owned, *self.opts.rest]
        parent = os.getpid()
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(parent))

    def _wait_proc(self) -> int:
        assert self.proc is not None
        while self.proc.poll() is None:
            self._sleep(1.0)
        return self.proc.returncode

    def _stop(self) -> None:
        proc = self.proc
        assert proc is not None
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            proc.wait(self.opts.stop_timeout)
        except subprocess.TimeoutExpired:
            say(f"torchrun did not stop within {self.opts.stop_timeout:g} s: killing it and its processes")
            for pid in [proc.pid, *descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()

    def _reap_leftovers(self, grace: float) -> None:
        """Workers torchrun left behind (reparented to this process, the subreaper): SIGTERM, then
        SIGKILL after ``grace`` seconds; reaped."""
        me, deadline, sent = os.getpid(), time.monotonic() + grace, None
        while True:
            for pid in child_pids(me):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            left = descendants(me)
            if not left:
                return
            sig = signal.SIGKILL if time.monotonic() >= deadline else signal.SIGTERM
            if sig != sent:
                say(f"{len(left)} processes outlived torchrun: {signal.Signals(sig).name} to them")
                for pid in left:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
                sent = sig
            time.sleep(0.05)

    def _cancel_pending(self) -> None:
        argv = ["scancel", "--state=PENDING", self.array_job_id]
        say(f"training done: cancelling the array's pending tasks ({' '.join(argv)}), so that none starts "
            "later with nobody to train with")
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=self.env)
        except (OSError, subprocess.TimeoutExpired) as e:
            say(f"scancel failed: {e}")
            return
        if r.returncode != 0:
            say(f"scancel exited {r.returncode}: {r.stderr.strip()[-300:]}")

    # --- main loop ---

    def run(self) -> int:
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for s in (*_FORWARDED, signal.SIGCHLD):
            signal.signal(s, self._on_signal)
        if sys.platform.startswith("linux"):
            prctl(PR_SET_CHILD_SUBREAPER, 1)
        try:
            return self._run()
        except Ending:
            return 128 + (self.ending or signal.SIGTERM)
        except Refused as e:
            say(str(e))
            return e.code
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self._stop()
            self._unpublish()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _run(self) -> int:
        retries = 0
        while True:
            self._take_signals()
            doc = self._publish() if self.host else self._wait_endpoint()
            owned = self.owned(doc)
            say(json.dumps({"start": retries + 1, "task": self.task, "host": self.host, "endpoint": endpoint(doc),
                            "rdzv_file": self.path, "nnodes": f"{self.nodes[0]}:{self.nodes[1]}",
                            "nproc_per_node": self.width, "torchrun": ["torchrun", *owned, *self.opts.rest]},
                           separators=(",", ":")))
            self.proc = self._spawn(owned)
            code = self._wait_proc()
            self.proc = None
            self._reap_leftovers(5.0)
            code = code if code >= 0 else 128 - code
            if self.ending is not None:
                return 128 + self.ending
            if code == 0:
                if self.host:
                    self._cancel_pending()
                return 0
            if self.host or retries >= self.opts.max_restarts or not self._store_gone(doc):
                return code
            retries += 1
            say(f"torchrun exited {code} and task 0's store at {endpoint(doc)} is gone: waiting for its next "
                f"rendezvous file (retry {retries} of {self.opts.max_restarts})")


def across_nodes(argv: list[str], launcher_args: LauncherArgs, initial_gpus: InitialGpus,
                 environ: Optional[dict] = None) -> Optional[int]:
    """The exit status when this task is one node of a training across an array's tasks; None when it
    is a training of its own (the one-node launcher's case). The width is computed as the one-node
    launcher computes it, by its own ``initial_gpus``."""
    env = dict(os.environ if environ is None else environ)
    rng = elastic_range(env)
    if not env.get("SLURM_ARRAY_JOB_ID") or rng is None:
        return None
    try:
        opts = parse_args(argv, launcher_args)
        gpus, width = initial_gpus(env, opts.width)
    except ValueError as e:  # the UsageError of either launcher
        if str(e):
            say(str(e))
            sys.stderr.write(USAGE)
            return 2
        sys.stdout.write(USAGE)
        return 0
    lo, hi = rng
    if hi <= width:
        return None
    try:
        if not P.JOB_ID_RE.match(env["SLURM_ARRAY_JOB_ID"]):
            raise Refused(f"SLURM_ARRAY_JOB_ID={env['SLURM_ARRAY_JOB_ID']!r}: expected a job id", 2)
        if hi % width:
            raise Refused(f"{P.ENV_ELASTIC}={lo}:{hi}: MAX is not a whole number of nodes of {width} GPUs "
                          f"(one array task per node: MAX = tasks x GPUs per task)", 2)
        task = NodeTask(opts, env, gpus, width, (-(-lo // width), hi // width))
    except Refused as e:
        say(str(e))
        return e.code
    return task.run()
