"""The processes a devcluster starts: each recorded by PID and executable, so ``down`` stops exactly those
(and never a recycled PID), munged shared with the host when the host runs one, and the reaping of
what a job leaves behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from slurm_antman.errors import AntmanError


MUNGED = "/usr/sbin/munged"


class DevclusterError(AntmanError):
    pass


@dataclass
class Proc:
    name: str
    pid: int
    exe: str

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A recycled PID belongs to some other program: treat ours as gone, and never signal it.
        try:
            return os.readlink(f"/proc/{self.pid}/exe") == os.path.realpath(self.exe)
        except OSError:
            return False


def _munge_works() -> bool:
    return subprocess.run(["munge", "-n"], capture_output=True).returncode == 0


def _munged_pids_here() -> list[int]:
    """munged processes whose root directory is ours. A munged in a chroot (make test-slurm24's
    trixie one) shares our PID namespace but serves another socket and key: it is not ours to
    wait for."""
    here = os.stat("/")
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "munged":
                continue
            root = os.stat(entry / "root")
        except OSError:  # gone meanwhile, or not ours to look at
            continue
        if (root.st_dev, root.st_ino) == (here.st_dev, here.st_ino):
            pids.append(int(entry.name))
    return pids


def _ensure_munged(procs: list[Proc]) -> None:
    if _munge_works():
        return
    # A munged that is still exiting (a cluster stopped a moment ago) is seen by pgrep but serves
    # nothing: wait for it to go, then start ours.
    for _ in range(100):
        if not _munged_pids_here():
            break
        time.sleep(0.1)
    else:
        raise DevclusterError("a munged process runs but munge -n fails: check /var/log/munge/munged.log")
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    r = subprocess.run(["runuser", "-u", "munge", "--", MUNGED], capture_output=True, text=True)
    if r.returncode:
        raise DevclusterError(f"munged failed to start: {r.stderr.strip()}")
    pidfile = Path("/run/munge/munged.pid")
    for _ in range(50):
        if pidfile.exists() and pidfile.read_text().strip():
            procs.append(Proc("munged", int(pidfile.read_text().strip()), os.path.realpath(MUNGED)))
            return
        time.sleep(0.1)
    raise DevclusterError("munged started but wrote no pid file")


def unified_cgroup_host(root: str = "/sys/fs/cgroup") -> bool:
    """Whether this host boots the unified cgroup v2 hierarchy (cgroup2 mounted at the cgroup root), as
    current distributions do, rather than cgroup v1 or the hybrid layout (v1 controllers beside an empty
    cgroup2), where Slurm's cgroup/v2 refuses to start."""
    try:
        with open("/proc/self/mounts", encoding="ascii", errors="replace") as f:
            return any(line.split()[1:3] == [root, "cgroup2"] for line in f if len(line.split()) > 2)
    except OSError:
        return False


def systemd_running() -> bool:
    """Whether systemd is this machine's init (sd_booted(3)'s test), not only installed."""
    return os.path.isdir("/run/systemd/system")


def delegated_scope(unit: str) -> list[str]:
    """On a unified cgroup v2 host, the command that starts a daemon the way a site's systemd unit does
    (Debian's slurmd.service sets ``Delegate=yes``): in a transient scope whose cgroup subtree is its own.
    Slurm's cgroup/v2 needs that: it moves slurmd into a child cgroup and enables controllers below it,
    which the kernel refuses in a cgroup that holds other processes ("Cannot migrate slurmd"). A scope
    execs the daemon in the same process, so its PID is the daemon's. Elsewhere: nothing."""
    if not unified_cgroup_host():
        return []
    if not systemd_running():  # slurmd makes its own (cgroup.conf IgnoreSystemd=yes, files.cgroup_conf)
        return []
    run = shutil.which("systemd-run")
    if run is None:
        raise DevclusterError("this host boots the unified cgroup v2 hierarchy, and slurmd needs a delegated "
                              "cgroup there: install systemd (systemd-run) or start slurmd from a unit "
                              "with Delegate=yes")
    return [run, "--scope", "--quiet", f"--unit={unit}", "--property=Delegate=yes", "--"]


def _spawn(name: str, argv: list[str], env: dict, log: Path, enter: Optional[list[str]] = None) -> Proc:
    """Start a daemon; ``enter``: the command that puts it on its host (nsenter into a network
    namespace), which execs the daemon in the same process."""
    exe = os.path.realpath(argv[0])
    with open(log, "ab") as out:
        p = subprocess.Popen([*(enter or []), *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    if enter:
        # Until nsenter has exec'd it, the PID is nsenter's: Proc.alive() would read it as gone.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.poll() is None:
            try:
                if os.readlink(f"/proc/{p.pid}/exe") == exe:
                    break
            except OSError:
                pass
            time.sleep(0.01)
    return Proc(name, p.pid, exe)


def _proc_children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    children = _proc_children()
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
