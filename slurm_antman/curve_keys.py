"""CURVE keys of the sidecar uplink: the coordinator's server key pair and one client key pair per node.

    KEY_DIR/                       0700 root
    KEY_DIR/coordinator.key        the coordinator's public key (every sidecar needs it)
    KEY_DIR/coordinator.key_secret its secret key (only the coordinator)
    KEY_DIR/sidecars/NODE.key      public keys the coordinator admits; the file name is the node
    KEY_DIR/nodes/NODE.key_secret  each node's key pair (copied to that node only)

``antman keys init --config antman.yaml [--nodes HOSTLIST] [--force]`` makes them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import zmq
import zmq.auth

from slurm_antman import config as cfgmod
from slurm_antman import hostlist
from slurm_antman.errors import AntmanError
from slurm_antman.protocol import NODE_NAME_RE

SERVER_NAME = "coordinator"


class KeysError(AntmanError, RuntimeError):
    """Keys that are missing or unusable; the message names the file and what to run."""


def server_public_path(key_dir: str | Path) -> Path:
    return Path(key_dir) / f"{SERVER_NAME}.key"


def server_secret_path(key_dir: str | Path) -> Path:
    return Path(key_dir) / f"{SERVER_NAME}.key_secret"


def sidecars_dir(key_dir: str | Path) -> Path:
    return Path(key_dir) / "sidecars"


def nodes_dir(key_dir: str | Path) -> Path:
    return Path(key_dir) / "nodes"


def _check_node(node: str) -> None:
    if not NODE_NAME_RE.match(node):
        raise KeysError(f"{node!r} is not a Slurm node name (letters, digits, '.', '_', '-'; it becomes a file name)")


def _load(path: Path, secret: bool) -> tuple[bytes, Optional[bytes]]:
    if not path.is_file():
        raise KeysError(f"{path}: no such key file (run `antman keys init --config antman.yaml`)")
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise KeysError(f"{path}: not a ZeroMQ CURVE certificate: {e}") from None
    if secret and not sec:
        raise KeysError(f"{path}: holds no secret key (expected a .key_secret file)")
    return public, sec


def load_server_keypair(key_dir: str | Path) -> tuple[bytes, bytes]:
    public, secret = _load(server_secret_path(key_dir), secret=True)
    assert secret is not None
    return public, secret


def load_server_public(key_dir: str | Path) -> bytes:
    return _load(server_public_path(key_dir), secret=False)[0]


def load_keypair(secret_file: str | Path) -> tuple[bytes, bytes]:
    public, secret = _load(Path(secret_file), secret=True)
    assert secret is not None
    return public, secret


def authorized_sidecars(key_dir: str | Path) -> dict[bytes, str]:
    """z85 public key -> node name, from ``sidecars/NODE.key``. Unreadable files are skipped (with
    their problem in the second return of :func:`scan_authorized`)."""
    return scan_authorized(key_dir)[0]


def scan_authorized(key_dir: str | Path) -> tuple[dict[bytes, str], list[str]]:
    keys: dict[bytes, str] = {}
    problems: list[str] = []
    d = sidecars_dir(key_dir)
    try:
        names = sorted(os.listdir(d))
    except OSError as e:
        return keys, [f"{d}: {e.strerror}"]
    for name in names:
        if not name.endswith(".key"):
            continue
        node = name[: -len(".key")]
        if not NODE_NAME_RE.match(node):
            problems.append(f"{d / name}: {node!r} is not a node name")
            continue
        try:
            public, _ = _load(d / name, secret=False)
        except KeysError as e:
            problems.append(str(e))
            continue
        if public in keys:
            problems.append(f"{d / name}: same public key as node {keys[public]}; ignored")
            continue
        keys[public] = node
    return keys, problems


def _secure_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _new_pair(tmp: Path, name: str) -> tuple[Path, Path]:
    public, secret = zmq.auth.create_certificates(str(tmp), name)
    for f in (public, secret):
        os.chmod(f, 0o600)
    return Path(public), Path(secret)


@dataclass
class InitResult:
    key_dir: Path
    created: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def init_keys(key_dir: str | Path, nodes: Sequence[str], force: bool = False) -> InitResult:
    """Create what is missing (everything with ``force``). Files appear whole: each pair is written
    in a private temporary directory and renamed into place."""
    for n in nodes:
        _check_node(n)
    root = Path(key_dir)
    result = InitResult(root)
    old_umask = os.umask(0o077)
    try:
        for d in (root, sidecars_dir(root), nodes_dir(root)):
            _secure_dir(d)
        with tempfile.TemporaryDirectory(dir=root, prefix=".new-") as tmp_s:
            tmp = Path(tmp_s)
            if force or not server_secret_path(root).is_file() or not server_public_path(root).is_file():
                pub, sec = _new_pair(tmp, SERVER_NAME)
                os.replace(sec, server_secret_path(root))
                os.replace(pub, server_public_path(root))
                result.created.append(SERVER_NAME)
            else:
                load_server_keypair(root)  # a damaged key must not be kept silently
                result.kept.append(SERVER_NAME)
            for node in nodes:
                secret_file = nodes_dir(root) / f"{node}.key_secret"
                public_file = sidecars_dir(root) / f"{node}.key"
                if not force and secret_file.is_file():
                    pub_now, _ = load_keypair(secret_file)
                    if not public_file.is_file() or _load(public_file, secret=False)[0] != pub_now:
                        # Re-authorize the node's existing key rather than rotate it.
                        _write_public(tmp, node, secret_file, public_file)
                    result.kept.append(node)
                    continue
                pub, sec = _new_pair(tmp, node)
                os.replace(sec, secret_file)
                os.replace(pub, public_file)
                result.created.append(node)
    finally:
        os.umask(old_umask)
    if os.geteuid() == 0:
        for dirpath, dirnames, filenames in os.walk(root):
            for n in (*dirnames, *filenames):
                os.chown(os.path.join(dirpath, n), 0, 0)
        os.chown(root, 0, 0)
    return result


def _write_public(tmp: Path, node: str, secret_file: Path, public_file: Path) -> None:
    staged = tmp / f"{node}.key_secret"
    shutil.copyfile(secret_file, staged)
    text = staged.read_text()
    # A certificate's public half is its secret file without the secret-key line.
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("secret-key")]
    staged_pub = tmp / f"{node}.key"
    staged_pub.write_text("\n".join(lines) + "\n")
    os.chmod(staged_pub, 0o600)
    os.replace(staged_pub, public_file)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="antman keys", description="CURVE keys of the sidecar-coordinator link.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    it = sub.add_parser("init", help="create the coordinator's and the nodes' key pairs (keeps existing ones)")
    it.add_argument("--config", required=True, help="antman.yaml (coordinator.key_dir says where the keys go)")
    it.add_argument("--nodes", help="Slurm hostlist of nodes to make keys for (default: every node in antman.yaml)")
    it.add_argument("--force", action="store_true", help="replace existing keys (every sidecar then needs its new key)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        conf = cfgmod.load(args.config)
    except cfgmod.ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if conf.coordinator.key_dir is None:
        print(f"antman keys: {args.config}: coordinator.key_dir is not set; add it (e.g. /etc/slurm-antman/keys)",
              file=sys.stderr)
        return 2
    known = list(conf.node_groups_by_host())
    if args.nodes:
        try:
            nodes = hostlist.expand(args.nodes)
        except hostlist.HostlistError as e:
            print(f"antman keys: --nodes: {e}", file=sys.stderr)
            return 2
        unknown = [n for n in nodes if n not in known]
        if unknown:
            print(f"antman keys: --nodes: {', '.join(unknown)} not in antman.yaml nodes", file=sys.stderr)
            return 2
    else:
        nodes = known
    try:
        res = init_keys(conf.coordinator.key_dir, nodes, force=args.force)
    except (KeysError, OSError) as e:
        print(f"antman keys: {e}", file=sys.stderr)
        return 1
    print(f"keys in {res.key_dir}: created {', '.join(res.created) or 'none'}; kept {', '.join(res.kept) or 'none'}")
    for node in nodes:
        path = conf.coordinator.secret_key_path(node)
        default = str(nodes_dir(res.key_dir) / f"{node}.key_secret")
        if path != default:
            print(f"  node {node}: copy {default} to {path} on {node} (mode 0600, owner root)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
