"""torchrun as ``torch_patch.elastic_launch`` runs it: ``python -m torch_patch._torchrun --antman-width=W
[torchrun options] SCRIPT [ARGS]``, or ``--antman-standby`` instead of the width: torch imported, the
width and GPU list read from stdin when the launcher needs it; or ``--antman-nodes=N`` followed by N
torchrun options of ``torch_patch.elastic_nodes`` (one node of a training across an array's tasks),
which then stand instead of the one-node settings below. Not for direct use.

It is ``python -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=W --max-restarts=0
[torchrun options] SCRIPT [ARGS]``, with three differences:

- the agent is kept out of this process: torchrun imports torch, and in a job the import hook
  (torch_patch.activation) would start an agent here that registers as one more rank. Its workers are
  new interpreters with the job's environment: each gets its agent as usual;
- the options the launcher owns are set here, after torchrun's own parser has read the user's: a
  user's ``--nproc-per-node``, ``--nnodes``, ``--standalone``, rendezvous or ``--max-restarts`` (other
  than 0) is refused with one line, rather than overriding the width or hiding behind it;
- SIGUSR1 (Slurm's ``--signal``) is passed on to the workers instead of ending torchrun (Python's
  default for it); SIGTERM/SIGINT stay torchrun's (it stops its workers), and end this process with
  128 + the signal, without a traceback and without tearing torch down (``os._exit``, once the
  workers are gone: a width change waits for this exit).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Optional

PROG = "antman-elastic-launch"
# (attribute, option as the user would write it, what the launcher sets)
OWNED = (
    ("nproc_per_node", "--nproc-per-node", "the width"),
    ("nnodes", "--nnodes", "1: one node"),
    ("standalone", "--standalone", "always"),
    ("rdzv_backend", "--rdzv-backend", "standalone's"),
    ("rdzv_endpoint", "--rdzv-endpoint", "standalone's"),
    ("rdzv_id", "--rdzv-id", "standalone's"),
    ("max_restarts", "--max-restarts", "0: a failed worker ends the job; see docs/elastic.md"),
)
# Across nodes (--antman-nodes) the launcher sets these too; its own --max-restarts sets the restarts.
NODES_OWNED = tuple((a, o, "across nodes: see docs/elastic.md") for a, o, _ in OWNED) + (
    ("rdzv_conf", "--rdzv-conf", "across nodes"), ("local_addr", "--local-addr", "across nodes: its --node-addr"))


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        try:
            ppid = int(stat.rsplit(b")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(name))
    return out


def say_as(prog: str, msg: str) -> None:
    """One line on stderr under the launcher's name; never raises (stderr may be gone at a job's end)."""
    try:
        sys.stderr.write(f"{prog}: {msg}\n")
        sys.stderr.flush()
    except Exception:
        pass


class UsageError(ValueError):
    """A launcher's option it cannot use: said in one line, exit status 2."""


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``: the workers a launcher must see gone before it starts new ones."""
    out, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, arg: int) -> None:
    """Linux prctl(2), best effort: elsewhere the launchers only lose the guarantees it adds."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except Exception:
        pass


def die_with_parent(parent: int) -> None:
    """In a launcher's child, before exec: SIGTERM when the launcher dies (torchrun then stops its
    workers), and exit at once if it died before this took hold."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:
        os._exit(1)


def _pass_on(signum: int, frame: object) -> None:
    for pid in child_pids(os.getpid()):
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].startswith(("--antman-width=", "--antman-standby", "--antman-nodes=")):
        sys.stderr.write(f"{PROG}: torch_patch._torchrun is started by torch_patch.elastic_launch\n")
        return 2
    first = argv.pop(0)
    standby = first == "--antman-standby"
    nodes = first.startswith("--antman-nodes=")
    width = 0 if standby else int(first.split("=", 1)[1])
    owned, argv = (argv[:width], argv[width:]) if nodes else ([], argv)
    from . import activation

    activation.remove_hook()  # before torch is imported: no agent in torchrun itself
    import torch.distributed.run as trun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    parser = trun.get_args_parser()
    args = parser.parse_args(argv)
    for attr, opt, what in NODES_OWNED if nodes else OWNED:
        got = getattr(args, attr, None)
        if got != parser.get_default(attr):
            sys.stderr.write(f"{PROG}: do not pass {opt} (got {got!r}): the launcher sets it ({what})\n")
            return 2
    if standby:
        # Imported and waiting: the launcher's next start costs no import of torch. One line on stdin
        # says go: {"width": W, "env": {NAME: value or null}}; end of file: not needed, leave.
        line = sys.stdin.buffer.readline()
        if not line.strip():
            os._exit(0)
        go = json.loads(line)
        width = int(go["width"])
        for name, value in go["env"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if nodes:
        args = parser.parse_args(owned + argv)
    else:
        args.standalone = True
        args.nnodes = "1"
        args.nproc_per_node = str(width)
        args.max_restarts = 0
    signal.signal(signal.SIGUSR1, _pass_on)
    try:
        record(trun.run)(args)
    except SignalException as e:
        # torchrun has stopped its workers and waited for them. Skip the interpreter's teardown of
        # torch (about half a second on a small machine): a width change waits for this exit.
        sys.stderr.write(f"{PROG}: torchrun stopped its workers on {signal.Signals(e.sigval).name}\n")
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(128 + int(e.sigval))
    except ChildFailedError as e:
        # torchrun itself exits 1 whatever the worker's status; the launcher passes on the training's.
        sys.stderr.write(e.format_msg() + "\n")
        _, failure = e.get_first_failure()
        code = int(failure.exitcode)
        return code if 0 < code < 256 else 128 - code if code < 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
