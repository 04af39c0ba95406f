"""antman.yaml: the model, its error messages, and `antman config check`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurm_antman import config, hostlist

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "etc" / "antman.yaml"


def _minimal(**over) -> dict:
    data = {"nodes": [{"name": "gpu[1-2]", "gpus": 4}]}
    data.update(over)
    return data


def _problems(data) -> dict[str, str]:
    with pytest.raises(config.ConfigError) as e:
        config.parse(data, "test.yaml")
    return dict(e.value.problems)


def test_example_file_is_valid_and_complete():
    cfg = config.load(EXAMPLE)
    assert [h for g in cfg.nodes for h in g.hosts] == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert {t.account: t.guaranteed_gpus for t in cfg.tenants} == {"vision": 16, "nlp": 12, "speech": 4}
    assert cfg.opportunistic.utilization_threshold == 0.8


def test_defaults():
    cfg = config.parse(_minimal())
    assert cfg.default_class.value == "none"
    assert cfg.slurm.opportunistic_gres == "antman_opp"
    assert cfg.opportunistic.slots_per_gpu == 2
    assert cfg.node_socket_dir("gpu1") == "/run/slurm-antman/gpu1"


@pytest.mark.parametrize("data, path, words", [
    (_minimal(default_class="sometimes"), "default_class", ["'sometimes'", "guaranteed", "opportunistic", "none"]),
    (_minimal(nodes=[{"name": "n1", "gpus": 0}]), "nodes.0.gpus", ["greater than or equal to 1"]),
    (_minimal(nodes=[{"name": "n[3-1]", "gpus": 1}]), "nodes.0.name", ["backwards"]),
    (_minimal(grace_time_s=-1), "grace_time_s", ["greater than or equal to 0"]),
    (_minimal(opportunistic={"utilization_threshold": 1.5}), "opportunistic.utilization_threshold", ["less than"]),
    (_minimal(sidecar={"telemetry": "gpu"}), "sidecar.telemetry", ["'gpu'", "nvml", "emulated"]),
    (_minimal(opportunistic={"min_progress": 0}), "opportunistic.min_progress", ["greater than 0"]),
    (_minimal(opportunistic={"move_after_s": -5}), "opportunistic.move_after_s", ["greater than 0"]),
    (_minimal(opportunistic={"move_gain": 0.5}), "opportunistic.move_gain", ["greater than or equal to 1"]),
    (_minimal(tenant=[]), "tenant", ["unknown field"]),
    (_minimal(tenants=[{"account": "a b", "guaranteed_gpus": 1}]), "tenants.0.account", ["Slurm account"]),
    (_minimal(slurm={"gpu_gres": "x", "opportunistic_gres": "x"}), "slurm", ["must differ"]),
])
def test_errors_name_field_and_allowed_values(data, path, words):
    problems = _problems(data)
    assert path in problems, problems
    for w in words:
        assert w in problems[path], problems[path]


def test_node_listed_twice_and_duplicate_tenant():
    p = _problems(_minimal(nodes=[{"name": "n[1-2]", "gpus": 1}, {"name": "n2", "gpus": 2}]))
    assert "'n2' appears in more than one" in " ".join(p.values())
    p = _problems(_minimal(tenants=[{"account": "a", "guaranteed_gpus": 1}, {"account": "a", "guaranteed_gpus": 2}]))
    assert "listed twice: a" in " ".join(p.values())


def test_missing_nodes_and_non_mapping():
    assert "nodes" in _problems({})
    assert "(top level)" in _problems(["a"])


def test_hostlist_expansion():
    assert hostlist.expand("n[01-03],x,y[7,9]") == ["n01", "n02", "n03", "x", "y7", "y9"]
    for bad in ("n[1-", "n]", "n[a-b]", "n[1-2],n2", ""):
        with pytest.raises(hostlist.HostlistError):
            hostlist.expand(bad)


def _check(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    f = tmp_path / "antman.yaml"
    f.write_text(text)
    return subprocess.run([sys.executable, "-m", "slurm_antman.cli", "config", "check", str(f)],
                          capture_output=True, text=True, cwd=REPO)


def test_cli_check_ok_and_errors(tmp_path):
    r = _check(tmp_path, EXAMPLE.read_text())
    assert r.returncode == 0 and "OK (4 nodes, 32 GPUs, 3 tenants" in r.stdout
    bad = yaml.safe_load(EXAMPLE.read_text())
    bad["opportunistic"]["slots_per_gpu"] = 99
    bad["sidecar"]["telemetry"] = "magic"
    r = _check(tmp_path, yaml.safe_dump(bad))
    assert r.returncode == 2
    assert "opportunistic.slots_per_gpu" in r.stderr and "less than or equal to 16" in r.stderr
    assert "sidecar.telemetry: 'magic' is not allowed" in r.stderr
    r = _check(tmp_path, "nodes: [\n  - name: a\n")
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "line" in r.stderr
