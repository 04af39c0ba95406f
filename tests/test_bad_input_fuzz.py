"""Bad input, fuzzed: antman.yaml and trace files. Whatever the bytes, the answer is
a one-line-per-problem error naming the file (ConfigError, TraceError), never another exception, a
hang or memory without bound. (The protocol decoder's fuzzing is in test_protocol.py and, on live
sockets, test_sidecar_daemon.py.)"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_antman import config
from slurm_antman.lab.evaluation import traces

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
keys = st.sampled_from(["nodes", "tenants", "sidecar", "opportunistic", "coordinator", "slurm", "name", "gpus",
                        "gpu_memory_mb", "account", "guaranteed_gpus", "slots_per_gpu", "no_room", "state_dir",
                        "grace_time_s", "heartbeat_s", "x"])
trees = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(keys, inner, max_size=5)), max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, trees, max_size=6))
def test_any_config_mapping_is_accepted_or_a_config_error(data):
    try:
        config.parse(data, "fuzz.yaml")
    except config.ConfigError as e:
        assert str(e).startswith("fuzz.yaml: invalid configuration")
        assert e.problems and all(path and msg for path, msg in e.problems)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_any_config_file_is_accepted_or_a_config_error(raw):
    with tempfile.NamedTemporaryFile(suffix=".yaml") as f:
        f.write(raw)
        f.flush()
        try:
            config.load(f.name)
        except config.ConfigError as e:
            assert str(e).startswith(f.name)


def _timed_load(path: Path) -> tuple[str, float]:
    t = time.monotonic()
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    return str(e.value), time.monotonic() - t


def test_an_alias_bomb_is_refused_without_expanding_it(tmp_path):
    # "Billion laughs": nine levels of nine references, 9^9 strings once expanded.
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    lines.append("nodes: *a9")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    text, _ = _timed_load(path)
    assert "aliases" in text and "bomb.yaml" in text


@pytest.mark.parametrize("opener,closer", [("[", "]"), ("{a: ", "}")])
def test_deep_nesting_is_a_config_error(tmp_path, opener, closer):
    path = tmp_path / "deep.yaml"
    path.write_text("nodes: " + opener * 50_000 + "1" + closer * 50_000 + "\n")
    text, _ = _timed_load(path)
    assert "deep.yaml" in text and "nested" in text


def test_an_oversized_config_file_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * 200_000)
    text, _ = _timed_load(path)
    assert "big.yaml" in text and "larger than" in text


PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"
OPENB_HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
                "deletion_time,scheduled_time\n")
cells = st.one_of(st.text(max_size=12), st.integers(-10, 10**12).map(str), st.floats().map(str),
                  st.just("2017-10-03 12:00:00"), st.just(""))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.sampled_from([PHILLY_HEADER, OPENB_HEADER, "", "a,b\n"]),
       rows=st.lists(st.lists(cells, max_size=12), max_size=6), tail=st.binary(max_size=40))
def test_any_trace_file_loads_or_is_a_trace_error_naming_the_file(tmp_path, header, rows, tail):
    path = tmp_path / "fuzz.csv"
    body = header + "".join(",".join(c.replace("\n", " ").replace("\r", " ") for c in r) + "\n" for r in rows)
    path.write_bytes(body.encode("utf-8", "surrogatepass") + tail)
    try:
        jobs = traces.load_sorted(path)
    except traces.TraceError as e:
        assert str(path) in str(e) or str(e).startswith("--window"), str(e)
        assert "\n" not in str(e).strip()
    else:
        assert all(j.gpus >= 1 and j.duration_s >= 0 for j in jobs)
