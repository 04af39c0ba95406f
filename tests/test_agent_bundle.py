"""The agent bundle: a job's own Python (a venv with torch and nothing else) loads the agent from the
directory the SPANK plugin puts on its PYTHONPATH, or says in one line why not and runs on."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import torch_patch
from slurm_antman.admin import agent_bundle
from slurm_antman.config import AntmanConfig
from slurm_antman.admin.render import RenderOptions, plugstack_conf

TAG = sys.implementation.cache_tag
PROBE = ("import torch, sys, torch_patch; z = sys.modules.get('zmq'); "
         "print(torch_patch.__file__); print(z.__file__ if z else None); print(torch_patch.current() is not None)")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return agent_bundle.build(tmp_path_factory.mktemp("b") / "agent").path


def _run(python: Path, code: str, pythonpath: str, job: bool = True) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "PYTHONWARNINGS": "ignore"}
    if job:
        env["ANTMAN_JOB_ID"] = "7"
    # cwd /: python -c puts the working directory on sys.path, and this checkout holds the packages
    return subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd="/")


def test_bundle_holds_the_agent_and_this_pythons_pyzmq(bundle):
    marker = json.loads((bundle / agent_bundle.MARKER).read_text())
    assert TAG in marker["zmq_builds"]
    assert (bundle / "_zmq" / TAG / "zmq" / "__init__.py").is_file()
    assert (bundle / "sitecustomize.py").read_text() == \
        (Path(torch_patch.__file__).parent / "bundle_loader.py").read_text()
    assert (bundle / "slurm_antman" / "protocol" / "codec.py").is_file() and (bundle / "torch_patch" / "agent.py").is_file()
    assert not list(bundle.rglob("__pycache__"))
    # Every file readable by every job's user, none writable but by its owner.
    for p in bundle.rglob("*"):
        assert p.stat().st_mode & 0o004 and not p.stat().st_mode & 0o022, p


def test_rebuild_replaces_a_bundle_and_nothing_else(tmp_path):
    first = agent_bundle.build(tmp_path / "agent").path
    (first / "stale.py").write_text("")
    again = agent_bundle.build(tmp_path / "agent").path
    assert again == first and not (again / "stale.py").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent"]  # no work or old directory left
    (tmp_path / "site").mkdir()
    with pytest.raises(agent_bundle.BundleError, match="not an agent bundle"):
        agent_bundle.build(tmp_path / "site")


def test_a_wheel_member_outside_the_bundle_is_refused(tmp_path):
    wheel = tmp_path / "pyzmq-27.0.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("zmq/__init__.py", "")
        z.writestr("zmq/../../../escaped.py", "")
    with pytest.raises(agent_bundle.BundleError, match="outside the bundle"):
        agent_bundle.build(tmp_path / "agent", zmq_wheels=(wheel,))
    assert not (tmp_path / "escaped.py").exists() and not (tmp_path / "agent").exists()
    with pytest.raises(agent_bundle.BundleError, match="--python '3.x'"):
        agent_bundle.build(tmp_path / "agent", pythons=("3.x",))


def test_torch_only_venv_gets_the_agent_from_the_bundle(bundle, torch_only_python):
    r = _run(torch_only_python, PROBE, str(bundle))
    assert r.returncode == 0, r.stderr
    patch_file, zmq_file, running = r.stdout.split()
    assert patch_file == str(bundle / "torch_patch" / "__init__.py")
    assert zmq_file == str(bundle / "_zmq" / TAG / "zmq" / "__init__.py")
    assert running == "True"


def test_no_pyzmq_for_this_python_is_one_line_and_the_job_runs(tmp_path, bundle, torch_only_python):
    import shutil

    other = tmp_path / "agent"
    shutil.copytree(bundle, other)
    shutil.rmtree(other / "_zmq" / TAG)
    r = _run(torch_only_python, "import torch; print('trained')", str(other))
    assert r.returncode == 0 and r.stdout.strip() == "trained", r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "slurm-antman" in ln]
    assert len(lines) == 1, r.stderr
    assert f"no build for {TAG}" in lines[0] and "pip install pyzmq" in lines[0] and str(other) in lines[0]
    assert "Traceback" not in r.stderr


def test_outside_a_job_the_bundle_loads_nothing(bundle, torch_only_python):
    r = _run(torch_only_python, "import torch, sys; print('torch_patch' in sys.modules, 'zmq' in sys.modules)",
             str(bundle), job=False)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr


@pytest.mark.parametrize("job", [True, False])
def test_the_shadowed_sitecustomize_still_runs(tmp_path, bundle, torch_only_python, job):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_OWN = 'ran'\n")
    r = _run(torch_only_python, "import builtins, torch, sys; print(getattr(builtins, 'SITE_OWN', None), "
             "'torch_patch' in sys.modules)", f"{bundle}:{own}", job=job)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ran", str(job)]


def test_plugstack_line_names_the_bundle_only_when_configured():
    base = {"nodes": [{"name": "gpu01", "gpus": 1}]}
    opts = RenderOptions(config_path="/etc/slurm-antman/antman.yaml", hook_dir="/etc/slurm-antman/rendered")
    on = plugstack_conf(AntmanConfig.model_validate({**base, "agent_path": "/opt/x/agent"}), opts)
    off = plugstack_conf(AntmanConfig.model_validate({**base, "agent_path": None}), opts)
    assert " agent_path=/opt/x/agent" in on.splitlines()[-1]
    assert "agent_path" not in off
    with pytest.raises(Exception, match="agent_path"):
        AntmanConfig.model_validate({**base, "agent_path": "relative/agent"})


def test_doctor_checks_the_bundle_on_gpu_nodes(tmp_path):
    import os

    from slurm_antman.admin import doctor

    path = agent_bundle.build(tmp_path / "agent").path
    cfg = AntmanConfig.model_validate({"nodes": [{"name": "gpu01", "gpus": 1}], "agent_path": str(path)})
    c = doctor.check_agent_bundle(cfg, "gpu01")
    assert c.status == "ok" and TAG in c.reason
    assert doctor.check_agent_bundle(cfg, "login1").status == "skip"
    os.chmod(path, 0o700)  # the jobs' users could not read it
    c = doctor.check_agent_bundle(cfg, "gpu01")
    assert c.status == "fail" and "not readable by every user" in c.reason
    os.chmod(path, 0o755)
    marker = json.loads((path / agent_bundle.MARKER).read_text())
    (path / agent_bundle.MARKER).write_text(json.dumps({**marker, "version": "0.0.1"}))
    c = doctor.check_agent_bundle(cfg, "gpu01")
    assert c.status == "warn" and "0.0.1" in c.reason and "agent-bundle --out" in c.hint
    gone = AntmanConfig.model_validate({"nodes": [{"name": "gpu01", "gpus": 1}], "agent_path": str(tmp_path / "no")})
    c = doctor.check_agent_bundle(gone, "gpu01")
    assert c.status == "fail" and "no agent bundle" in c.reason and "make install" in c.hint
