"""Slurm carried to a machine that has none: Debian's packages, unpacked into a prefix, never into ``/``.

The GPU machine of ``make gpu-site-proof`` is bare (docs/gpu_proof.md, "A Slurm site on the GPU"): no
Slurm, no munge, no network. What it needs travels with the tree, in a bundle made here:

- ``debs/``: Debian 12's Slurm 22.05 (slurmctld, slurmd, the client commands, the basic plugins,
  libslurm) and munge, exactly the packages this machine's Slurm came from (``apt-get download``), and
  the packages of every shared library they link against beyond the C library (found with ``ldd`` on
  what the Slurm packages hold, each library's package named by ``dpkg -S``);
- ``antman_spank.so``: the SPANK plugin built here against the same release's headers (the GPU
  machine may have no compiler, and has no Slurm headers);
- ``manifest.json``: what is in it and where it came from.

``unpack`` puts the packages into a prefix there with ``dpkg-deb -x`` (Ubuntu and Debian have it) and
keeps, of the libraries, only those whose soname the machine's own loader does not know
(``ldconfig -p``): a carried library never shadows the machine's own, so nothing else there (PyTorch,
CUDA) loads Debian 12's copy of a library it already has. Each Slurm command and daemon is reached
through a small wrapper in ``PREFIX/bin`` that puts the carried libraries on its LD_LIBRARY_PATH (the
packages' binaries look for libslurmfull in /usr/lib/x86_64-linux-gnu/slurm-wlm, their RUNPATH, which
is not there): a Prolog, the coordinator's ``scontrol`` and a user's ``sbatch`` all find them the same
way, by PATH. slurmd is told where slurmstepd is (``-d``), slurm.conf where the plugins are
(``PluginDir=``), and munged runs from the prefix with its key, socket, seed and log under it
(``AuthInfo=socket=`` in slurm.conf tells the auth plugin where).

Standard library only (but ``build`` without ``--spank``): ``selftest`` runs in a root with nothing but
Python (.ci/bare-root, tests/test_carried_slurm.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

# Debian 12's Slurm 22.05.8 and munge 0.5.15: the release this machine's devcluster runs (make deps), so
# the SPANK plugin built here against its headers loads there.
SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurm-wlm-basic-plugins", "libslurm38", "munge",
                  "libmunge2")
# The C library's own objects: every Linux machine has them, and a second copy would break the loader.
GLIBC = ("libc.so", "libm.so", "libdl.so", "libpthread.so", "librt.so", "libresolv.so", "libutil.so",
         "ld-linux", "linux-vdso", "libanl.so", "libnsl.so")
MULTIARCH = "x86_64-linux-gnu"
PLUGIN_SUBDIR = f"usr/lib/{MULTIARCH}/slurm-wlm"
# The commands and daemons a site proof runs (and the agent's and the coordinator's Slurm calls).
COMMANDS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "sacct", "salloc", "sprio", "sstat")
DAEMONS = ("slurmctld", "slurmd", "slurmstepd")
MUNGE = ("munge", "unmunge", "mungekey")
CACHE = Path(os.environ.get("ANTMAN_CARRIED_SLURM_CACHE", "/var/cache/slurm-antman/carried-slurm"))


class CarryError(RuntimeError):
    pass


def _run(argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, **kw)


# --- made here: the bundle --------------------------------------------------------------------------

def _download(packages: Sequence[str], into: Path) -> list[Path]:
    """The .deb of each package at the version installed here (cached: a second build downloads nothing)."""
    into.mkdir(parents=True, exist_ok=True)
    out = []
    for pkg in packages:
        r = _run(["dpkg-query", "-W", "-f", "${Version} ${Architecture}", pkg])
        if r.returncode:
            raise CarryError(f"{pkg} is not installed here: the bundle carries this machine's own Slurm "
                             "(make deps installs it)")
        version, arch = r.stdout.split()
        have = sorted(into.glob(f"{pkg}_*_{arch}.deb"))
        if not have:
            # This machine's own version first; a mirror that has moved on (a point release, a rebuild)
            # gives its current one of the same release, which is as good for a library.
            for spec in (f"{pkg}={version}", pkg):
                r = _run(["apt-get", "download", "-q", spec], cwd=into)
                have = sorted(into.glob(f"{pkg}_*_{arch}.deb"))
                if r.returncode == 0 and have:
                    break
            else:
                raise CarryError(f"apt-get download {pkg} failed: {r.stderr.strip()[-400:]}")
        deb = have[-1]
        if "%3a" in deb.name:  # apt names a file with an epoch "pkg_1%3a2.0_arch.deb": kept without it
            deb = deb.rename(into / deb.name.replace(deb.name.split("_")[1], deb.name.split("_")[1].split("%3a")[-1]))
        name = deb.name
        out.append(into / name)
    return out


def _elf_files(root: Path) -> list[Path]:
    found = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    found.append(p)
    return found


def linked_libraries(root: Path) -> dict[str, str]:
    """soname -> the path this machine's loader resolves it to, for every library an ELF file under
    ``root`` links against, beyond the C library and Slurm's own (libslurmfull, beside the plugins, which the
    wrappers put on the path). libmunge is one of them: it comes from a package of the bundle, and lies
    with the other libraries there."""
    own = {p.name for p in (root / PLUGIN_SUBDIR).glob("*.so*")}
    libs: dict[str, str] = {}
    for elf in _elf_files(root):
        r = _run(["ldd", str(elf)])
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/"):
                soname = parts[0]
                if soname in own or soname.startswith(GLIBC):
                    continue
                libs[soname] = parts[2]
    return libs


def _owning_package(path: str) -> str:
    # dpkg knows a library by the path its package installed; on a merged /usr that may be either.
    real = os.path.realpath(path)
    for candidate in dict.fromkeys([path, real, path.replace("/usr/lib/", "/lib/"), real.replace("/usr/lib/", "/lib/"),
                                    path.replace("/lib/", "/usr/lib/", 1) if not path.startswith("/usr/") else path]):
        r = _run(["dpkg", "-S", candidate])
        if r.returncode == 0:
            return r.stdout.split(":", 1)[0].strip()
    raise CarryError(f"no package of this machine holds {path}")


def build(dest: Path, spank_so: Optional[Path] = None, cache: Path = CACHE) -> dict:
    """The bundle in ``dest`` (made afresh): the Slurm and munge packages, their libraries' packages, the
    SPANK plugin, and a manifest."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise CarryError("building the carried Slurm needs Debian's apt-get and dpkg (a Debian 12 machine)")
    slurm_debs = _download(SLURM_PACKAGES, cache)
    with tempfile.TemporaryDirectory(prefix="antman-carry-") as tmp:
        root = Path(tmp)
        for deb in slurm_debs:
            _dpkg_x(deb, root)
        libs = linked_libraries(root)
    lib_packages = sorted({_owning_package(p) for p in libs.values()} - set(SLURM_PACKAGES))
    lib_debs = _download(lib_packages, cache)
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "debs").mkdir(parents=True)
    for deb in [*slurm_debs, *lib_debs]:
        shutil.copy2(deb, dest / "debs" / deb.name)
    if spank_so is not None:
        shutil.copy2(spank_so, dest / "antman_spank.so")
    manifest = {
        "slurm_packages": [d.name for d in slurm_debs],
        "library_packages": [d.name for d in lib_debs],
        "sonames": sorted(libs),
        "spank_plugin": "antman_spank.so" if spank_so is not None else None,
        "built_on": _run(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]).stdout.strip(),
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def bundle_bytes(dest: Path) -> int:
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())


# --- there: the prefix ------------------------------------------------------------------------------

def _dpkg_x(deb: Path, root: Path) -> None:
    r = _run(["dpkg-deb", "-x", str(deb), str(root)])
    if r.returncode:
        raise CarryError(f"dpkg-deb -x {deb.name} failed: {r.stderr.strip()}")


def known_sonames() -> set[str]:
    """The sonames this machine's loader finds on its own (``ldconfig -p``)."""
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            r = _run([ldconfig, "-p"])
        except FileNotFoundError:
            continue
        if r.returncode == 0:
            return {line.split()[0] for line in r.stdout.splitlines()[1:] if line.strip()}
    return set()


@dataclass(frozen=True)
class Prefix:
    """A carried Slurm unpacked: where each part is."""
    path: Path

    @property
    def root(self) -> Path:  # the packages' tree, as they would lie in /
        return self.path / "root"

    @property
    def bin(self) -> Path:  # the wrappers: first on PATH
        return self.path / "bin"

    @property
    def lib(self) -> Path:  # the carried libraries the machine lacks
        return self.path / "lib"

    @property
    def plugin_dir(self) -> Path:
        return self.root / PLUGIN_SUBDIR

    @property
    def slurmstepd(self) -> Path:
        return self.bin / "slurmstepd"

    @property
    def munge_dir(self) -> Path:
        return self.path / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def spank_plugin(self) -> Optional[Path]:
        p = self.path / "antman_spank.so"
        return p if p.exists() else None

    def library_path(self) -> str:
        return f"{self.lib}:{self.plugin_dir}"

    def env(self, base: Optional[dict] = None) -> dict:
        """``base`` (default: this process's) with the wrappers first on PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin}:{env.get('PATH') or '/usr/sbin:/usr/bin:/sbin:/bin'}"
        return env

    def slurm_conf_lines(self) -> list[str]:
        return [f"PluginDir={self.plugin_dir}", f"AuthInfo=socket={self.munge_socket}"]


def unpack(bundle: Path, prefix: Path, known: Optional[set[str]] = None) -> Prefix:
    """The bundle's packages into ``prefix`` (made afresh), its wrappers, and of the libraries only those
    this machine lacks (``known``: the sonames its loader finds; default ``ldconfig -p``)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    p = Prefix(prefix.resolve())
    if p.path.exists():
        shutil.rmtree(p.path)
    p.root.mkdir(parents=True)
    for name in [*manifest["slurm_packages"], *manifest["library_packages"]]:
        _dpkg_x(bundle / "debs" / name, p.root)
    known = known_sonames() if known is None else known
    p.lib.mkdir()
    carried = []
    for d in (p.root / "lib" / MULTIARCH, p.root / "usr" / "lib" / MULTIARCH):
        if not d.is_dir():
            continue
        for lib in sorted(d.glob("*.so.*")):
            if lib.name in manifest["sonames"] and lib.name not in known:
                shutil.copy2(lib, p.lib / lib.name, follow_symlinks=True)
                carried.append(lib.name)
    if manifest.get("spank_plugin"):
        shutil.copy2(bundle / manifest["spank_plugin"], p.path / "antman_spank.so")
    p.bin.mkdir()
    for name in COMMANDS + MUNGE + DAEMONS + ("munged",):
        for d in ("usr/bin", "usr/sbin"):
            # Debian installs the daemons as NAME-wlm and points NAME at them with update-alternatives,
            # which an unpacked package never ran: the link is made here. The name matters, not only
            # the file: Slurm decides by its program name whether it runs as slurmctld or slurmd (a
            # slurmctld started as "slurmctld-wlm" reads no node's GRES from slurm.conf, and refuses
            # every GPU job as "Requested node configuration is not available").
            real = p.root / d / f"{name}-wlm"
            if real.is_file() and not (p.root / d / name).exists():
                (p.root / d / name).symlink_to(real.name)
            _wrapper(p, p.root / d / name, name)
    p.munge_dir.mkdir()
    p.munge_dir.chmod(0o755)  # a job's sbatch and srun, as its user, reach the socket in it
    (p.path / "carried.json").write_text(json.dumps({"libraries": carried, "machine_has": sorted(
        set(manifest["sonames"]) - set(carried))}, indent=2) + "\n")
    return p


def _wrapper(p: Prefix, target: Path, name: str) -> None:
    if not target.exists():
        return
    w = p.bin / name
    if w.exists():
        return
    # exec -a keeps the program's own name in ps and in its messages; slurmd finds slurmstepd through
    # this wrapper too (slurmd -d), so every step runs with the carried libraries.
    w.write_text(f"#!/bin/bash\nLD_LIBRARY_PATH='{p.library_path()}'${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\n"
                 f"export LD_LIBRARY_PATH\nexec -a {name} '{target}' \"$@\"\n")
    w.chmod(0o755)


def missing_libraries(p: Prefix) -> dict[str, list[str]]:
    """ELF file -> the libraries it links against that the loader cannot find, with the carried ones on
    its path: empty when the prefix is complete."""
    env = {**os.environ, "LD_LIBRARY_PATH": p.library_path()}
    out = {}
    for elf in _elf_files(p.root):
        r = _run(["ldd", str(elf)], env=env)
        gone = [line.split()[0] for line in r.stdout.splitlines() if "not found" in line]
        if gone:
            out[str(elf.relative_to(p.root))] = gone
    return out


def start_munged(p: Prefix, log: Path) -> int:
    """munged from the prefix, as root, with a fresh key: everything under PREFIX/munge. Its PID."""
    key = p.munge_dir / "munge.key"
    if not key.exists():
        r = _run([str(p.bin / "mungekey"), "--create", "--force", f"--keyfile={key}"])
        if r.returncode:
            raise CarryError(f"mungekey failed: {r.stderr.strip()}")
    key.chmod(0o600)
    pidfile = p.munge_dir / "munged.pid"
    pidfile.unlink(missing_ok=True)
    # --force: munged as root, which a site never does; here the machine is ours alone for the run.
    r = _run([str(p.bin / "munged"), "--force", f"--socket={p.munge_socket}", f"--key-file={key}",
              f"--pid-file={pidfile}", f"--log-file={log}", f"--seed-file={p.munge_dir / 'munged.seed'}"])
    if r.returncode:
        raise CarryError(f"munged failed to start: {r.stderr.strip() or r.stdout.strip()}")
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            return int(pidfile.read_text().strip())
        time.sleep(0.05)
    raise CarryError("munged started but wrote no pid file")


def daemon_program(p: Prefix, name: str) -> Path:
    """The real program of daemon ``name`` (not its wrapper), for a caller that gives it the carried
    libraries itself and must see the program's own PID and executable."""
    for d in ("usr/sbin", "usr/bin"):
        if (p.root / d / name).is_file():
            return p.root / d / name
    raise CarryError(f"the carried Slurm in {p.path} has no {name}")


def munged_program(p: Prefix) -> Path:
    return daemon_program(p, "munged")


def munge_works(p: Prefix) -> bool:
    r = _run([str(p.bin / "munge"), "-n", f"--socket={p.munge_socket}"])
    return r.returncode == 0


# --- the self-test: a one-node cluster from the prefix alone -------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def selftest(bundle: Path, work: Path) -> dict:
    """Unpack ``bundle`` into ``work``/prefix, start munged, slurmctld and one slurmd from it (loopback,
    no cgroups, no accounting), run a job step and a batch job, stop every process by PID. What it saw."""
    p = unpack(bundle, work / "prefix")
    out: dict = {"missing_libraries": missing_libraries(p)}
    if out["missing_libraries"]:
        raise CarryError(f"libraries not found: {json.dumps(out['missing_libraries'])}")
    for sub in ("etc", "state", "log", "spool"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    port = _free_port()
    conf = work / "etc" / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=carried", "SlurmctldHost=localhost", f"SlurmctldPort={port}", f"SlurmdPort={port + 1}",
        "SlurmUser=root", "AuthType=auth/munge", "CredType=cred/munge", *p.slurm_conf_lines(),
        f"StateSaveLocation={work}/state", f"SlurmdSpoolDir={work}/spool",
        f"SlurmctldPidFile={work}/state/slurmctld.pid", f"SlurmdPidFile={work}/state/slurmd.pid",
        f"SlurmctldLogFile={work}/log/slurmctld.log", f"SlurmdLogFile={work}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "NodeName=localhost CPUs=1 State=UNKNOWN", "PartitionName=main Nodes=localhost Default=YES State=UP",
    ]) + "\n")
    env = p.env()
    env["SLURM_CONF"] = str(conf)
    pids: list[int] = []
    try:
        pids.append(start_munged(p, work / "log" / "munged.log"))
        if not munge_works(p):
            raise CarryError("munge -n fails against the carried munged")
        for argv, log in (([str(p.bin / "slurmctld"), "-D", "-c", "-i"], "slurmctld.out"),
                          ([str(p.bin / "slurmd"), "-D", "-N", "localhost", "-d", str(p.slurmstepd)], "slurmd.out")):
            with open(work / "log" / log, "ab") as f:
                pids.append(subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True).pid)
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            r = _run(["sinfo", "-h", "-o", "%T"], env=env)
            state = r.stdout.strip() or r.stderr.strip()
            if r.returncode == 0 and state.startswith("idle"):
                break
            time.sleep(0.5)
        else:
            raise CarryError(f"the node did not come up: {state}; see {work}/log")
        out["sinfo"] = state
        out["version"] = _run(["sinfo", "--version"], env=env).stdout.strip()
        r = _run(["srun", "-N1", "-t", "1", "sh", "-c", "echo step-ran $SLURM_JOB_ID"], env=env, timeout=60)
        out["srun"] = r.stdout.strip() or r.stderr.strip()
        if "step-ran" not in r.stdout:
            raise CarryError(f"srun failed: {out['srun']}")
        r = _run(["sbatch", "--parsable", "-o", str(work / "batch.out"), "--wrap", "echo batch-ran"], env=env)
        if r.returncode:
            raise CarryError(f"sbatch failed: {r.stderr.strip()}")
        jid = r.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "batch-ran" not in _read(work / "batch.out"):
            time.sleep(0.5)
        out["batch"] = _read(work / "batch.out").strip()
        if "batch-ran" not in out["batch"]:
            raise CarryError(f"batch job {jid} did not run; see {work}/log")
        return out
    finally:
        for pid in reversed(pids):
            _stop(pid)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _stop(pid: int, timeout: float = 15) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child (munged daemonized): poll its existence
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_antman.lab.devcluster.carried_slurm",
                                 description="Slurm carried to a machine that has none (docs/gpu_proof.md).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="make the bundle here (a Debian 12 machine with make deps done)")
    b.add_argument("--out", required=True, type=Path, help="the bundle's directory (made afresh)")
    b.add_argument("--spank", type=Path, help="the SPANK plugin built against this Slurm (default: build it "
                   "from this checkout against /usr/include/slurm)")
    t = sub.add_parser("selftest", help="unpack a bundle and run a job on a one-node cluster from it alone")
    t.add_argument("--bundle", required=True, type=Path, help="a bundle made by build")
    t.add_argument("--work", required=True, type=Path, help="where the prefix, the cluster's files and its logs go")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            spank = a.spank
            if spank is None:
                from .files import build_spank  # needs the devcluster's own imports: not in a bare root

                a.out.mkdir(parents=True, exist_ok=True)
                spank = build_spank(a.out.parent / "antman_spank.so")
            m = build(a.out, spank)
            print(json.dumps({**m, "bytes": bundle_bytes(a.out)}, indent=2))
        else:
            print(json.dumps(selftest(a.bundle, a.work), indent=2))
    except (CarryError, OSError, subprocess.SubprocessError) as e:
        print(f"carried Slurm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
