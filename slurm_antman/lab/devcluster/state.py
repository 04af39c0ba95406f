"""What a running devcluster is, written to its directory (``cluster.json``: the processes ``up``
started, the shape it was asked for), so that ``down``, ``status`` and a later ``up`` find it."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .dirs import DEFAULT_DIR
from .hosts import DEV_USER, Hosts
from .processes import Proc



@dataclass
class Cluster:
    dir: Path
    nodes: list[str]
    gpus: int
    port_base: int
    plain: bool
    procs: list[Proc] = field(default_factory=list)
    accounting: bool = False  # slurmdbd and MariaDB run beside slurmctld (devcluster.accounting)
    user: str = DEV_USER  # the unprivileged user jobs are submitted as
    hosts: Optional["Hosts"] = None  # each node a network namespace of its own (``up(hosts=True)``)
    installed: Optional[str] = None  # PREFIX of a `make install` the daemons and hooks run from (``up(installed=)``)
    slurm_prefix: Optional[str] = None  # a carried Slurm's prefix (``up(slurm_prefix=)``; lab.devcluster.carried_slurm)

    @property
    def slurm_conf(self) -> Path:
        return self.dir / "etc" / "slurm.conf"

    @property
    def config_path(self) -> Path:
        return self.dir / "antman.yaml"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.exports())
        return env

    def exports(self) -> dict[str, str]:
        out = {"SLURM_CONF": str(self.slurm_conf), "ANTMAN_CONFIG": str(self.config_path)}
        if self.slurm_prefix:  # the carried Slurm's commands (wrappers that find its libraries) come first
            path = os.environ.get("PATH") or "/usr/sbin:/usr/bin:/sbin:/bin"
            own = f"{self.slurm_prefix}/bin"
            out["PATH"] = path if path.split(":")[0] == own else f"{own}:{path}"
        return out

    def run(self, args: list[str], check: bool = False, timeout: float = 60, env: dict | None = None,
            as_user: tuple[int, int] | None = None, host: str = "ctl", **kw) -> subprocess.CompletedProcess:
        """A command on the cluster: Slurm's clients reach slurmctld from the controller's host (its
        network namespace, when the nodes are hosts of their own). ``as_user``: (uid, gid) to run it as."""
        argv = list(args)
        if as_user is not None:
            # setpriv, not subprocess's user=: nsenter must still be root when it runs.
            argv = ["setpriv", f"--reuid={as_user[0]}", f"--regid={as_user[1]}", "--clear-groups", "--", *argv]
        if self.hosts is not None:
            argv = self.hosts.enter(host) + argv
        return subprocess.run(argv, env=env or self.env, capture_output=True, text=True, check=check,
                              timeout=timeout, **kw)

    def to_json(self) -> dict:
        return {
            "dir": str(self.dir), "nodes": self.nodes, "gpus": self.gpus, "port_base": self.port_base,
            "plain": self.plain, "slurm_conf": str(self.slurm_conf),
            "procs": [p.__dict__ for p in self.procs], "accounting": self.accounting, "user": self.user,
            "hosts": self.hosts.to_json() if self.hosts else None, "installed": self.installed,
            "slurm_prefix": self.slurm_prefix,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Cluster":
        return cls(Path(data["dir"]), data["nodes"], data["gpus"], data["port_base"], data["plain"],
                   [Proc(**p) for p in data["procs"]], bool(data.get("accounting", False)),
                   str(data.get("user", DEV_USER)), Hosts.from_json(data["hosts"]) if data.get("hosts") else None,
                   data.get("installed"), data.get("slurm_prefix"))


def _state_file(d: Path) -> Path:
    return d / "cluster.json"


def load(d: Path = DEFAULT_DIR) -> Cluster | None:
    f = _state_file(Path(d))
    if not f.exists():
        return None
    return Cluster.from_json(json.loads(f.read_text()))


def _shape_file(d: Path) -> Path:
    return d / "up.json"


def is_running(cluster: Cluster) -> bool:
    """Every daemon ``up`` started still runs. munged may be the host's own (then not ours to watch)."""
    return all(p.alive() for p in cluster.procs if p.name != "munged")


def running(d: Path = DEFAULT_DIR) -> Cluster | None:
    """The cluster running in ``d``, or None."""
    cluster = load(Path(d).resolve())
    return cluster if cluster is not None and is_running(cluster) else None


def shape_differences(d: Path, asked: dict) -> list[str]:
    """What ``asked`` (``up``'s arguments that make a cluster what it is) sets otherwise than the cluster
    started in ``d`` was asked for, as 'name: running X, asked Y'. A cluster started before ``up`` wrote
    its arguments down has none."""
    try:
        had = json.loads(_shape_file(Path(d)).read_text())
    except (OSError, ValueError):
        return []
    want = json.loads(json.dumps(asked, default=str))  # as stored: tuples become lists, paths strings
    return [f"{k}: running {had[k]!r}, asked {v!r}" for k, v in want.items() if k in had and had[k] != v]


def _enter(cluster: "Cluster", host: str) -> Optional[list[str]]:
    return cluster.hosts.enter(host) if cluster.hosts is not None else None
