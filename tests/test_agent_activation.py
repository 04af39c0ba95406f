"""The import hook: the agent loads itself into a job's `import torch`, and nowhere else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from slurm_antman.lab.bench.control import PeerSidecar

PTH = "slurm_antman_torch_patch.pth"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = (
    "import sys; import torch; "
    "print('patched' if 'torch_patch.agent' in sys.modules and sys.modules['torch_patch.agent'].current() "
    "else 'plain', torch.__spec__.loader.__class__.__name__)"
)


def _site_has_hook() -> bool:
    return os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], PTH))


@pytest.fixture(autouse=True)
def _installed():
    if not _site_has_hook():
        pytest.fail(f"{PTH} is not in site-packages: install the project first (pip install -e {REPO} --no-deps)")


def _run(env_extra: dict, code: str = PROBE, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTMAN_", "SLURM_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd="/")


def test_without_the_job_env_nothing_is_loaded():
    r = _run({}, "import sys, torch; print(sorted(m for m in sys.modules if m.startswith('torch_patch')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_with_the_job_env_import_torch_starts_the_agent_and_registers(tmp_path):
    path = f"/tmp/antman-act-{os.getpid()}/jobs/77/agent.sock"
    peer = PeerSidecar(path, job_id="77", heartbeat_s=0.2).start()
    try:
        r = _run({"ANTMAN_JOB_ID": "77", "ANTMAN_CLASS": "opportunistic", "ANTMAN_SIDECAR_ENDPOINT": peer.endpoint},
                 PROBE + "; import torch_patch; assert torch_patch.current().client.registered.wait(10); print('registered')")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["patched", "SourceFileLoader", "registered"]
        reg = peer.wait_type("register").msg.body
        assert reg.job_id == "77" and reg.job_class == "opportunistic" and reg.pid != os.getpid()
        assert peer.wait_type("bye").msg.body.reason == "exit"
    finally:
        peer.stop()
        import shutil

        shutil.rmtree(f"/tmp/antman-act-{os.getpid()}", ignore_errors=True)


def test_explicit_install_before_torch_is_imported_builds_one_agent():
    """torch_patch.install() first thing in a job: building the agent imports torch, whose import
    hook must not wait for the install in progress (it deadlocked) nor build a second agent."""
    code = ("import torch_patch; a = torch_patch.install(job_class='opportunistic'); import torch; "
            "print(a is torch_patch.current(), a is torch_patch.install(), a.job_class)")
    r = _run({"ANTMAN_JOB_ID": "78", "ANTMAN_CLASS": "guaranteed"}, code, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "opportunistic"]


def test_class_alone_activates_without_a_sidecar():
    r = _run({"ANTMAN_CLASS": "guaranteed"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "patched"


def test_agent_errors_never_break_import_torch():
    r = _run({"ANTMAN_JOB_ID": "5", "ANTMAN_CLASS": "bogus"}, PROBE + "; print(torch.ones(2).sum().item())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["plain", "SourceFileLoader", "2.0"]
    assert "ANTMAN_CLASS='bogus'" in r.stderr and "runs without the agent" in r.stderr


def test_disable_switch():
    r = _run({"ANTMAN_JOB_ID": "5", "ANTMAN_AGENT_DISABLE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "plain"


def test_a_normal_wheel_ships_the_hook_at_the_top_of_site_packages(tmp_path):
    # Build from a copy: an in-tree build would write build/ into the working tree.
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.so", "*.o")
    for name in ("pyproject.toml", "README.md", "slurm_antman", "sidecar", "torch_patch"):
        if os.path.isdir(os.path.join(REPO, name)):
            shutil.copytree(os.path.join(REPO, name), src / name, ignore=ignore)
        elif os.path.exists(os.path.join(REPO, name)):
            shutil.copy(os.path.join(REPO, name), src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    (whl,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / whl).namelist()
    assert PTH in names and "torch_patch/activation.py" in names
