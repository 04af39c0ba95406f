"""The SPANK plugin builds cleanly, exports only plugin symbols, and works in the allocator context.

sbatch/salloc/srun load plugstack.conf and run the plugin's option callbacks before they contact
slurmctld, so these tests need Slurm's client commands and headers but no running cluster. Where a
submission must get as far as the controller, a loopback socket stands in for it and records the
request sbatch sends, which carries the job control environment the plugin set.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SPANK_DIR = REPO / "spank"
PLUGIN_EXPORTS = {
    "plugin_name",
    "plugin_type",
    "plugin_version",
    "spank_plugin_version",
    "slurm_spank_init",
    "slurm_spank_init_post_opt",
    "slurm_spank_task_init_privileged",
    "slurm_spank_task_init",
    "slurm_spank_exit",
}
ALLOWED_EXPORT_PREFIXES = ("slurm_spank_", "spank_plugin_")
ALLOWED_EXPORTS = {"plugin_name", "plugin_type", "plugin_version"}

pytestmark = [
    pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed"),
    pytest.mark.skipif(
        not Path("/usr/include/slurm/spank.h").exists(), reason="Slurm headers (libslurm-dev) are not installed"
    ),
    pytest.mark.timeout(120),
]

needs_slurm_clients = pytest.mark.skipif(
    shutil.which("sbatch") is None, reason="Slurm client commands (slurm-client) are not installed"
)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Builds into a private directory so a concurrent in-place build cannot interfere."""
    build = tmp_path_factory.mktemp("spank-build")
    res = _run(["make", "-C", str(SPANK_DIR), f"BUILDDIR={build}"])
    assert res.returncode == 0, f"make failed:\n{res.stdout}\n{res.stderr}"
    so = build / "antman_spank.so"
    assert so.is_file()
    return so


def test_warnings_are_errors(plugin: Path) -> None:
    # The fixture's build passed, so with these flags on the code compiles without a single warning.
    res = _run(["make", "-C", str(SPANK_DIR), "-n", f"BUILDDIR={plugin.parent}", "-B"])
    assert res.returncode == 0, res.stderr
    assert "-Werror" in res.stdout and "-Wall" in res.stdout and "-Wextra" in res.stdout


def test_a_header_change_rebuilds_the_files_that_include_it(plugin: Path) -> None:
    # The plugin is split by SPANK context into several objects; the compiler's dependency files
    # (-MMD) make an edited header rebuild exactly the objects that include it.
    def rebuilt(header: str) -> set[str]:
        res = _run(
            ["make", "-C", str(SPANK_DIR), "-n", f"BUILDDIR={plugin.parent}", "-W", str(SPANK_DIR / header)]
        )
        assert res.returncode == 0, res.stderr
        words = res.stdout.split()
        return {Path(words[i + 1]).name for i, w in enumerate(words[:-1]) if w == "-o"}

    assert _run(["make", "-C", str(SPANK_DIR), "-q", f"BUILDDIR={plugin.parent}"]).returncode == 0
    # cgroup_bpf.c alone has no Slurm in it (no common.h, no spank.h): tests/c/bpf_grant_driver.c links it alone.
    objects = {p.stem + ".o" for p in SPANK_DIR.glob("*.c")} - {"cgroup_bpf.o"}
    assert rebuilt("common.h") >= objects | {"antman_spank.so"}
    assert "cgroup_bpf.o" not in rebuilt("common.h")
    assert {"cgroup_bpf.o", "devices.o"} <= rebuilt("cgroup_bpf.h") and "prolog.o" not in rebuilt("cgroup_bpf.h")
    assert "prolog.o" in rebuilt("prolog.h") and "submit.o" not in rebuilt("prolog.h")
    assert "submit.o" in rebuilt("args.h") and "prolog.o" not in rebuilt("args.h")


def test_only_plugin_symbols_are_exported(plugin: Path) -> None:
    res = _run(["nm", "-D", "--defined-only", str(plugin)])
    assert res.returncode == 0, res.stderr
    exported = {line.split()[-1] for line in res.stdout.splitlines() if line.strip()}
    unexpected = {
        s for s in exported if s not in ALLOWED_EXPORTS and not s.startswith(ALLOWED_EXPORT_PREFIXES)
    }
    assert not unexpected, f"symbols leaked from the plugin: {sorted(unexpected)}"
    assert PLUGIN_EXPORTS <= exported, f"missing plugin symbols: {sorted(PLUGIN_EXPORTS - exported)}"


def test_install_honours_destdir_and_plugindir(plugin: Path, tmp_path: Path) -> None:
    dest = tmp_path / "root"
    res = _run(
        ["make", "-C", str(SPANK_DIR), f"BUILDDIR={plugin.parent}", f"DESTDIR={dest}", "install"]
    )
    assert res.returncode == 0, res.stderr
    # The Debian plugin directory for this architecture (no slurm.pc on Debian).
    assert [p.relative_to(dest).parts[:2] for p in dest.glob("usr/lib/*/slurm-wlm/antman_spank.so")] == [
        ("usr", "lib")
    ]
    res = _run(
        [
            "make", "-C", str(SPANK_DIR), f"BUILDDIR={plugin.parent}", f"DESTDIR={dest}",
            "PLUGINDIR=/opt/slurm/lib/slurm", "install",
        ]
    )
    assert res.returncode == 0, res.stderr
    installed = dest / "opt/slurm/lib/slurm/antman_spank.so"
    assert installed.read_bytes() == plugin.read_bytes()


class FakeController:
    """A loopback listener on slurmctld's port: records the first request, then hangs up."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.sock.settimeout(20)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(1.0)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass  # sbatch waits for a reply once it has sent everything; the timeout ends the read

    def close(self) -> None:
        self.sock.close()
        self._thread.join(timeout=5)


@pytest.fixture()
def slurm_conf(tmp_path: Path, plugin: Path):
    """A minimal slurm.conf + plugstack.conf; returns a function that writes them for a controller port."""

    def write(ctld_port: int, plugin_args: str = f"state_dir={tmp_path}/state") -> dict[str, str]:
        conf = tmp_path / "slurm.conf"
        plugstack = tmp_path / "plugstack.conf"
        conf.write_text(
            "ClusterName=spanktest\n"
            "SlurmctldHost=localhost\n"
            f"SlurmctldPort={ctld_port}\n"
            "MessageTimeout=5\n"
            f"PlugStackConfig={plugstack}\n"
            "NodeName=n1 NodeHostname=localhost CPUs=1 State=UNKNOWN\n"
            "PartitionName=p Nodes=n1 Default=YES\n"
        )
        plugstack.write_text(f"required {plugin} {plugin_args}\n")
        env = dict(os.environ, SLURM_CONF=str(conf))
        for var in list(env):
            # A surrounding allocation would turn srun/sbatch into something else.
            if var.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and var != "SLURM_CONF":
                del env[var]
        return env

    return write


@pytest.fixture(scope="module")
def munged():
    """sbatch signs its request with munge before it sends it: a munged must answer. Started here
    when none does (this file alone, on a fresh machine), and stopped again by its PID."""
    import signal

    from slurm_antman.lab.devcluster import cluster as dc

    started: list = []
    dc._ensure_munged(started)
    yield
    for p in started:
        if p.alive():
            os.kill(p.pid, signal.SIGTERM)


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_slurm_clients
def test_help_lists_the_option(slurm_conf) -> None:
    env = slurm_conf(_unused_port())
    for cmd in ("sbatch", "salloc", "srun"):
        res = _run([cmd, "--help"], env=env)
        assert res.returncode == 0, f"{cmd} --help: {res.stderr}"
        flat = " ".join(res.stdout.split())
        assert "--antman=CLASS" in flat, f"{cmd} --help does not list --antman"
        assert "slurm-antman job class: guaranteed, opportunistic or auto" in flat


@needs_slurm_clients
@pytest.mark.parametrize("cmd", ["sbatch", "salloc", "srun"])
@pytest.mark.parametrize("value", ["bogus", "Guaranteed", ""])
def test_invalid_class_is_rejected_before_submission(slurm_conf, cmd: str, value: str) -> None:
    env = slurm_conf(_unused_port())
    argv = [cmd, f"--antman={value}"] + (["--wrap", "true"] if cmd == "sbatch" else ["true"])
    res = _run(argv, env=env)
    assert res.returncode != 0
    assert f"--antman: invalid value '{value}'" in res.stderr
    assert "allowed values: guaranteed, opportunistic, auto" in res.stderr
    # Rejected by the plugin, not by a failed contact with the (absent) controller.
    assert "Unable to contact" not in res.stderr


@needs_slurm_clients
def test_control_character_in_value_is_escaped(slurm_conf) -> None:
    env = slurm_conf(_unused_port())
    res = _run(["sbatch", "--antman=a\x1bb", "--wrap", "true"], env=env)
    assert res.returncode != 0
    assert "invalid value 'a\\x1bb'" in res.stderr
    assert "\x1b" not in res.stderr.split("Invalid --antman argument")[0]


@needs_slurm_clients
@pytest.mark.parametrize("value", ["guaranteed", "opportunistic", "auto"])
def test_valid_class_reaches_the_submit_request(slurm_conf, munged, value: str) -> None:
    ctld = FakeController()
    try:
        env = slurm_conf(ctld.port)
        res = _run(["sbatch", f"--antman={value}", "--wrap", "true"], env=env)
    finally:
        ctld.close()
    # The fake controller never answers, so sbatch fails after sending; what matters is what it sent.
    assert res.returncode != 0
    assert "Invalid --antman" not in res.stderr
    assert f"ANTMAN_CLASS={value}".encode() in ctld.received, "job control env lacks ANTMAN_CLASS"


@needs_slurm_clients
def test_no_option_sets_no_class(slurm_conf, munged) -> None:
    ctld = FakeController()
    try:
        env = slurm_conf(ctld.port)
        _run(["sbatch", "--wrap", "true"], env=env)
    finally:
        ctld.close()
    assert b"#!/bin/sh" in ctld.received, "sbatch did not get as far as sending the job"
    assert b"ANTMAN_CLASS" not in ctld.received


@needs_slurm_clients
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("statedir=/x", "unknown plugstack.conf argument 'statedir=/x'; allowed: state_dir=PATH, prolog=PATH, "
                        "opp_partition=NAME"),
        ("state_dir=relative/dir", "state_dir must be an absolute path, got 'relative/dir'"),
        ("prolog=etc/antman-prolog", "prolog must be an absolute path, got 'etc/antman-prolog'"),
        ("opp_partition=", "opp_partition must be a partition name of 1 to 127 bytes, got ''"),
    ],
)
def test_bad_plugin_argument_fails_loading(slurm_conf, args: str, message: str) -> None:
    env = slurm_conf(_unused_port(), plugin_args=args)
    res = _run(["sbatch", "--help"], env=env)
    assert message in res.stderr
    assert "--antman" not in res.stdout
    res = _run(["sbatch", "--antman=auto", "--wrap", "true"], env=env)
    assert res.returncode != 0
    assert "Failed to initialize plugin stack" in res.stderr


@needs_slurm_clients
def test_restart_fallback_arguments_are_accepted(slurm_conf, tmp_path: Path) -> None:
    env = slurm_conf(_unused_port(), plugin_args=f"state_dir={tmp_path}/state prolog=/usr/libexec/antman/antman-prolog "
                                                 "opp_partition=opportunistic")
    res = _run(["sbatch", "--help"], env=env)
    assert res.returncode == 0, res.stderr
    assert "--antman=CLASS" in " ".join(res.stdout.split())
    assert "plugstack.conf argument" not in res.stderr
