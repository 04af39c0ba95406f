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
    assert cfg.opportunistic.slots_per_gpu == 3
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


# Strict configuration: what YAML or pydantic would convert silently is an error naming the
# field and the line it is on.

STRICT_BASE = """\
cluster_name: c1
grace_time_s: 30
opportunistic:
  utilization_threshold: 0.5
nodes:
  - name: gpu[1-2]
    gpus: 8
"""


def _load_error(tmp_path: Path, text: str) -> config.ConfigError:
    f = tmp_path / "antman.yaml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(f)
    return e.value


def _by_field(err: config.ConfigError) -> dict[str, tuple[int | None, str]]:
    return {path: (line, msg) for (path, msg), line in zip(err.problems, err.lines)}


def test_strict_base_file_loads_and_ints_stand_for_floats(tmp_path):
    f = tmp_path / "antman.yaml"
    f.write_text(STRICT_BASE + "sidecar:\n  heartbeat_s: 2\ndefault_class: opportunistic\n")
    cfg = config.load(f)
    assert cfg.nodes[0].gpus == 8 and cfg.grace_time_s == 30
    # int -> float loses nothing, so it stays allowed; the enum is read from its name.
    assert cfg.sidecar.heartbeat_s == 2.0 and isinstance(cfg.sidecar.heartbeat_s, float)
    assert cfg.default_class is config.DefaultClass.opportunistic


def test_duplicate_key_names_field_and_both_lines(tmp_path):
    err = _load_error(tmp_path, STRICT_BASE + "    gpus: 2\n")
    assert _by_field(err) == {"nodes.0.gpus": (8, "duplicate key 'gpus' (first at line 7)")}
    assert "line 8: nodes.0.gpus: duplicate key 'gpus' (first at line 7)" in str(err)
    err = _load_error(tmp_path, STRICT_BASE + "grace_time_s: 10\n")
    assert _by_field(err) == {"grace_time_s": (8, "duplicate key 'grace_time_s' (first at line 2)")}


@pytest.mark.parametrize("old, new, field, line, words", [
    ("grace_time_s: 30", "grace_time_s: true", "grace_time_s", 2, "expected an integer, got a boolean (true)"),
    ("utilization_threshold: 0.5", "utilization_threshold: false", "opportunistic.utilization_threshold", 4,
     "expected a number, got a boolean (false)"),
    ("cluster_name: c1", "cluster_name: 123", "cluster_name", 1, "expected a string, got a number (123)"),
    ("name: gpu[1-2]", "name: 1.0", "nodes.0.name", 6, "expected a string, got a number (1.0)"),
    ("gpus: 8", 'gpus: "8"', "nodes.0.gpus", 7, "expected an integer, got a string ('8')"),
    ("gpus: 8", "gpus: 8.0", "nodes.0.gpus", 7, "expected an integer, got a number (8.0)"),
    ("gpus: 8", "gpus: 010", "nodes.0.gpus", 7, "YAML reads '010' as 8"),
    ("grace_time_s: 30", "grace_time_s: 1:30", "grace_time_s", 2, "YAML reads '1:30' as 90"),
    ("cluster_name: c1", "cluster_name: yes", "cluster_name", 1, "YAML 1.1 reads 'yes' as the boolean true"),
])
def test_wrong_type_names_field_and_line(tmp_path, old, new, field, line, words):
    assert old in STRICT_BASE
    err = _load_error(tmp_path, STRICT_BASE.replace(old, new))
    problems = _by_field(err)
    assert field in problems, problems
    assert problems[field][0] == line and words in problems[field][1], problems[field]
    assert f"line {line}: {field}: " in str(err)


def test_yaml_11_booleans_must_be_written_true_or_false(tmp_path):
    err = _load_error(tmp_path, STRICT_BASE.replace("opportunistic:\n", "opportunistic:\n  upgrade_running: on\n"))
    assert _by_field(err)["opportunistic.upgrade_running"][0] == 4
    assert "YAML 1.1 reads 'on' as the boolean true; write true or false" in str(err)
    # The text 'off' (query_endpoint's way to turn it off) is fine once quoted.
    f = tmp_path / "ok.yaml"
    f.write_text(STRICT_BASE + "coordinator:\n  query_endpoint: 'off'\nsidecar:\n  enforce: false\n")
    cfg = config.load(f)
    assert cfg.coordinator.query_address() is None and cfg.sidecar.enforce is False


def test_merge_key_may_override_what_it_merges(tmp_path):
    f = tmp_path / "antman.yaml"
    f.write_text("nodes:\n  - &g {name: a1, gpus: 2}\n  - <<: *g\n    name: b1\n")
    assert [(g.name, g.gpus) for g in config.load(f).nodes] == [("a1", 2), ("b1", 2)]


def test_cli_check_refuses_the_issue_cases(tmp_path):
    r = _check(tmp_path, STRICT_BASE.replace("grace_time_s: 30", "grace_time_s: true") + "    gpus: 2\n")
    assert r.returncode == 2
    assert "line 8: nodes.0.gpus: duplicate key 'gpus' (first at line 7)" in r.stderr
    r = _check(tmp_path, STRICT_BASE.replace("grace_time_s: 30", "grace_time_s: true"))
    assert r.returncode == 2
    assert "line 2: grace_time_s: expected an integer, got a boolean (true)" in r.stderr
