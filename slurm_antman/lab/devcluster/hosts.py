"""Who and where the devcluster runs: its unprivileged user (jobs are submitted as it, as at a site
where nobody submits as root) and, with ``up(hosts=True)``, each node a host of its own (a network
namespace with one interface, joined to the controller's by a bridge)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .processes import DevclusterError



# The cluster's ordinary user: tests and `antman devcluster up`'s users submit as it, as at a site
# where nobody submits as root.
DEV_USER = "antman-dev"


def let_users_through(path: Path) -> None:
    """o+x on ``path`` and the directories above it up to /tmp (or /): the cluster's ordinary user must
    reach its slurm.conf, the emulated GPUs and the sidecar sockets under a cluster directory that may
    sit in a private temporary directory (pytest makes its own 0700; it puts the mode back on its next run)."""
    for p in [path, *path.parents]:
        if p == Path("/tmp") or p == p.parent:
            break
        try:
            p.chmod(p.stat().st_mode | 0o055)
        except OSError:
            break


def ensure_user(name: str = DEV_USER) -> tuple[int, int]:
    """(uid, gid) of the devcluster's unprivileged user, made on first use (a home directory of its
    own: PyTorch and pip write caches there)."""
    import pwd

    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        r = subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", "--user-group",
                            "--comment", "slurm-antman devcluster user", name], capture_output=True, text=True)
        if r.returncode not in (0, 9):  # 9: made meanwhile by another run
            raise DevclusterError(f"cannot create the devcluster user {name}: {r.stderr.strip()}")
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid

HOSTS_SUBNET = "10.231.0"  # inside the cluster's own network namespaces only: nothing else sees it

NETNS_DIR = Path("/run/netns")


@dataclass
class Hosts:
    """Every node a host of its own: its slurmd and sidecar in a network namespace with one interface
    and one address; slurmctld, slurmdbd, MariaDB and the coordinator in the controller's namespace,
    which holds the bridge that joins them. Every message between a node and the controller crosses a
    real interface, to an address only the cluster's own namespaces have. (The file system, munge's
    socket and the UTS name are shared: what a site shares through its configuration management.)"""

    prefix: str
    nodes: list[str]

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return f"{HOSTS_SUBNET}.1" if host == "ctl" else f"{HOSTS_SUBNET}.{11 + self.nodes.index(host)}"

    def enter(self, host: str) -> list[str]:
        # nsenter switches the network namespace only; `ip netns exec` would also remount /sys and hide
        # the cgroup hierarchies slurmd's task/cgroup needs.
        return ["nsenter", f"--net={NETNS_DIR / self.ns(host)}", "--"]

    def to_json(self) -> dict:
        return {"prefix": self.prefix, "nodes": self.nodes}

    @classmethod
    def from_json(cls, data: dict) -> "Hosts":
        return cls(str(data["prefix"]), list(data["nodes"]))

    def create(self) -> None:
        self.remove()  # what a killed run left behind
        ctl = self.ns("ctl")
        _ip("netns", "add", ctl)
        _ip_in(ctl, "link", "set", "lo", "up")
        _ip_in(ctl, "link", "add", "br0", "type", "bridge")
        _ip_in(ctl, "addr", "add", f"{self.addr('ctl')}/24", "dev", "br0")
        _ip_in(ctl, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes):
            ns = self.ns(node)
            _ip("netns", "add", ns)
            _ip_in(ns, "link", "set", "lo", "up")
            # Both ends are made inside the cluster's namespaces: nothing appears in the host's own.
            _ip_in(ctl, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip_in(ctl, "link", "set", f"v{i}", "master", "br0", "up")
            _ip_in(ns, "addr", "add", f"{self.addr(node)}/24", "dev", "eth0")
            _ip_in(ns, "link", "set", "eth0", "up")

    def remove(self) -> None:
        for host in ["ctl", *self.nodes]:
            if (NETNS_DIR / self.ns(host)).exists():
                subprocess.run(["ip", "netns", "del", self.ns(host)], capture_output=True)

    def link(self, node: str, up: bool) -> None:
        """Connect or cut ``node``'s cable (its port on the controller's bridge): a network failure."""
        _ip_in(self.ns("ctl"), "link", "set", f"v{self.nodes.index(node)}", "up" if up else "down")


def _ip(*args: str, enter: Optional[list[str]] = None) -> None:
    r = subprocess.run([*(enter or []), "ip", *args], capture_output=True, text=True)
    if r.returncode:
        raise DevclusterError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")


def _ip_in(ns: str, *args: str) -> None:
    """``ip`` inside network namespace ``ns``. Not ``ip -n``: like ``ip netns exec`` it remounts /sys,
    which fails where / is no mount point (make test-slurm24's chroot)."""
    _ip(*args, enter=["nsenter", f"--net={NETNS_DIR / ns}", "--"])
