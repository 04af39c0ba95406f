"""Which Slurm is installed, whether slurm-antman supports it, and what differs between versions.

Every difference between the Slurm versions slurm-antman runs on is decided here, by version, so the
rest of the code keeps one path: the devcluster asks :func:`cred_type_line`, the adapter asks
:func:`nodes_argv`. Tested: Debian 12's 22.05, Debian 13's 24.11 and Debian sid's 26.05 (``make test``, ``make
test-slurm24`` and ``make test-cgroup2``, the last on a unified cgroup v2 guest), and 25.11 built from
SchedMD's source, by hand (docs/admin.md, "Supported Slurm versions": no Debian suite carries it and CI
cannot fetch it). 23.02, 23.11 and 25.05 lie between them and are accepted, but nothing here ran on them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Optional

from .errors import SlurmError, SlurmUnavailable

Version = tuple[int, int, int]

OLDEST: tuple[int, int] = (22, 5)
NEWEST: tuple[int, int] = (26, 5)
TESTED: tuple[tuple[int, int], ...] = ((22, 5), (24, 11), (25, 11), (26, 5))
# Slurm's releases between OLDEST and NEWEST: inside the range, not run by any test here.
UNTESTED: tuple[tuple[int, int], ...] = ((23, 2), (23, 11), (25, 5))

_VERSION_RE = re.compile(r"(?<![\d.])(\d{2})\.(\d{1,2})\.(\d+)")


class UnsupportedSlurm(SlurmError):
    """The installed Slurm is outside the range slurm-antman supports."""


def fmt(v: tuple[int, ...]) -> str:
    """``(24, 11, 5)`` -> ``24.11.5``; ``(22, 5)`` -> ``22.05``."""
    return ".".join([str(v[0]), f"{v[1]:02d}", *(str(x) for x in v[2:])])


def supported_text() -> str:
    """One phrase naming what is supported, for messages and docs."""
    names = [fmt(v) for v in TESTED]
    tested = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
    return f"Slurm {fmt(OLDEST)} to {fmt(NEWEST)} (tested on {tested})"


def parse_version(text: str) -> Version:
    """``slurm-wlm 24.11.5`` / ``slurm 22.05.8`` / ``24.11.5`` -> ``(24, 11, 5)``."""
    m = _VERSION_RE.search(text or "")
    if not m:
        raise SlurmError(f"cannot read a Slurm version in {(text or '').strip()[:80]!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def check_supported(v: Version) -> Version:
    """``v`` when slurm-antman supports it; else UnsupportedSlurm with one line naming both."""
    if not OLDEST <= tuple(v[:2]) <= NEWEST:
        raise UnsupportedSlurm(f"Slurm {fmt(v)} is not supported: slurm-antman supports {supported_text()}")
    return v


def is_tested(v: Version) -> bool:
    return tuple(v[:2]) in TESTED


CLIENT_FIRST = (("sinfo", "--version"), ("slurmctld", "-V"), ("slurmd", "-V"))
DAEMON_FIRST = (("slurmctld", "-V"), ("slurmd", "-V"), ("sinfo", "--version"))


def installed_version(env: Optional[Mapping[str, str]] = None, timeout: float = 30,
                      commands: tuple[tuple[str, str], ...] = CLIENT_FIRST) -> Version:
    """The Slurm installed here, from the first of ``commands`` that tells. 24.11's client commands
    need a slurm.conf even for ``--version`` (fine for the adapter, which has one); ``slurmctld -V``
    does not (the devcluster asks before it writes its slurm.conf: DAEMON_FIRST). Commands are looked
    up on ``env``'s PATH, daemons also in /usr/sbin."""
    env = dict(env if env is not None else os.environ)
    tried = []
    for argv in commands:
        exe = shutil.which(argv[0], path=env.get("PATH"))
        if exe is None and argv[0].startswith("slurm") and Path(f"/usr/sbin/{argv[0]}").exists():
            exe = f"/usr/sbin/{argv[0]}"
        if exe is None:
            continue
        try:
            r = subprocess.run([exe, *argv[1:]], env=env, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{argv[0]}: {e}")
            continue
        try:
            return parse_version(r.stdout)
        except SlurmError:
            tried.append(f"{' '.join(argv)}: {(r.stderr or r.stdout).strip()[-120:]}")
    if not tried:
        raise SlurmUnavailable(f"cannot tell which Slurm is installed: none of "
                               f"{', '.join(c[0] for c in commands)} found (are Slurm's commands installed?)")
    raise SlurmError("cannot tell which Slurm is installed: " + "; ".join(tried))


# --- what differs ------------------------------------------------------------------------------

def cred_type_line(v: Version) -> str:
    """slurm.conf's credential plugin: 23.11 renamed CryptoType=crypto/munge to CredType=cred/munge."""
    return "CredType=cred/munge" if tuple(v[:2]) >= (23, 11) else "CryptoType=crypto/munge"


def nodes_argv(v: Version) -> list[str]:
    """The command whose JSON lists one entry per node. 22.05's ``sinfo --json`` does; from 23.11
    ``sinfo --json`` groups nodes by partition and state (a ``sinfo`` list), and ``scontrol show nodes
    --json`` (23.02 on) gives the per-node list with the same field names."""
    return ["scontrol", "show", "nodes", "--json"] if tuple(v[:2]) >= (23, 11) else ["sinfo", "--json"]


def many_prolog_lines(v: Version) -> bool:
    """Whether slurm.conf may name several Prolog (and Epilog) programs, one ``Prolog=`` line each, all
    run. 24.11's slurm.conf(5) says so; 22.05 keeps the last line only, so a second line would drop the
    site's own hook. 23.02 and 23.11 are untested here: treated as one program, the safe side."""
    return tuple(v[:2]) >= (24, 11)


def job_show_json(v: Version) -> bool:
    """Whether one job is read from ``scontrol show job --json`` rather than ``scontrol show job -o -d``.
    From 25.11 the one-line form prints ``SubmitLine=``, the submission's command line verbatim
    (src/scontrol/info_job.c): an ``sbatch --wrap`` script's newlines split the "one line" into many, and
    a user's text could then pass for another job's record. The JSON form (data_parser, 23.02 on) has the
    same fields without that ambiguity; the text form stays where it is unambiguous, as tested."""
    return tuple(v[:2]) >= (25, 11)


def commands_dir(which=shutil.which) -> Optional[str]:
    """The directory of the ``scontrol`` on this PATH when it is not a system directory (a Slurm built into a
    prefix, /opt/slurm/bin), for the hooks' PATH (admin.render.RenderOptions.slurm_bin); None otherwise."""
    found = which("scontrol")
    if not found:
        return None
    d = os.path.dirname(os.path.realpath(found))
    return None if d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin", "/usr/local/bin", "/usr/local/sbin") else d
