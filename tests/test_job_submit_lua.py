"""etc/job_submit.lua (the one line calling etc/antman_job_submit.lua) and etc/examples/job_submit.lua (a
site's own script calling it) run for real under lua5.1, with tests/lua/harness.lua standing in for
slurmctld."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "etc" / "job_submit.lua"
SITE_SCRIPT = ROOT / "etc" / "examples" / "job_submit.lua"
# What is installed next to job_submit.lua with it (the directory of slurm.conf).
MODULE_FILES = ("antman_job_submit.lua", "antman_settings_loader.lua")
HARNESS = ROOT / "tests" / "lua" / "harness.lua"
LUA = shutil.which("lua5.1")

pytestmark = pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed (apt-get install lua5.1)")

NO_VAL = 4294967294
NO_VAL16 = 65534

SETTINGS: dict[str, Any] = {
    "default_class": "none",
    "auto_class": "guaranteed",
    "gpu_gres": "gpu",
    "opp_gres": "antman_opp",
    "guaranteed_partition": "gpu",
    "opp_partition": "opportunistic",
    "max_node_gpus": 4,
    "opp_switch_wait_s": 300,
}


def lua_literal(v: Any) -> str:
    """Python value -> Lua source. Lists become 0-indexed tables, like 22.05's spank_job_env."""
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "{" + ", ".join(f"[{i}] = {lua_literal(x)}" for i, x in enumerate(v)) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"[{lua_literal(k)}] = {lua_literal(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as Lua")


def desc(cls: Optional[str] = None, **fields: Any) -> dict[str, Any]:
    """A job_desc as sbatch sends it in 22.05: unset numbers are NO_VAL/NO_VAL16."""
    d: dict[str, Any] = {
        "name": "train", "user_name": "alice", "user_id": 1000,
        "min_nodes": NO_VAL, "max_nodes": NO_VAL, "num_tasks": NO_VAL,
        "ntasks_per_node": NO_VAL16, "sockets_per_node": NO_VAL16, "ntasks_per_tres": NO_VAL16,
        "requeue": NO_VAL16, "het_job_offset": NO_VAL, "req_switch": NO_VAL, "wait4switch": NO_VAL,
    }
    if cls is not None:
        # the plugin's own option mirror sits next to ANTMAN_CLASS, as seen on a real 22.05 ctld
        d["spank_job_env"] = [f"_SLURM_SPANK_OPTION_antman_antman={cls}", f"ANTMAN_CLASS={cls}"]
    d.update(fields)
    return d


def _harness(tmp_path: Path, case: dict[str, Any], settings: Optional[dict[str, Any]],
             settings_text: Optional[str], script: Path | str = SCRIPT) -> dict[str, Any]:
    """``script``: the job_submit.lua to install (a path, or its text)."""
    d = tmp_path / "etc"
    d.mkdir(exist_ok=True)
    if isinstance(script, Path):
        shutil.copy(script, d / "job_submit.lua")
    else:
        (d / "job_submit.lua").write_text(script)
    for name in MODULE_FILES:
        if not (d / name).exists():  # a test may have put a broken one there
            shutil.copy(ROOT / "etc" / name, d / name)
    settings_file = d / "antman_settings.lua"
    if settings_text is not None:
        settings_file.write_text(settings_text)
    elif settings != {}:
        merged = {**SETTINGS, **(settings or {})}
        settings_file.write_text("return " + lua_literal(merged) + "\n")
    case_file = tmp_path / "case.lua"
    case_file.write_text("return " + lua_literal(case) + "\n")
    proc = subprocess.run([LUA, str(HARNESS), str(d / "job_submit.lua"), str(case_file)],
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "load_error" not in out, out
    return out


def _result(out: dict[str, Any]) -> dict[str, Any]:
    assert "call_error" not in out, out
    if out["job_desc"] == []:
        out["job_desc"] = {}
    return out


def run(tmp_path: Path, job_desc: dict[str, Any], *, settings: Optional[dict[str, Any]] = None,
        settings_text: Optional[str] = None, call: str = "submit",
        job_rec: Optional[dict[str, Any]] = None, uid: int = 1000, script: Path | str = SCRIPT) -> dict[str, Any]:
    case = {"call": call, "job_desc": job_desc, "job_rec": job_rec or {}, "uid": uid}
    return _result(_harness(tmp_path, case, settings, settings_text, script))


def run_steps(tmp_path: Path, steps: list[dict[str, Any]], *,
              settings: Optional[dict[str, Any]] = None, script: Path | str = SCRIPT) -> list[dict[str, Any]]:
    """Several calls into ONE loaded script, as slurmctld keeps its Lua state between submissions.
    A step is {"job_desc": ..., "now": T} (a submit at os.time() T) or {"write": NAME, "text": ...}."""
    out = _harness(tmp_path, {"steps": [{"call": st.get("call", "submit"), **st} if "job_desc" in st else st
                                        for st in steps]}, settings, None, script)
    return [_result(r) for r in out["results"]]


def accepted(out: dict[str, Any]) -> dict[str, Any]:
    assert out["rc"] == 0, out["user"]
    return out["job_desc"]


def rejected(out: dict[str, Any]) -> str:
    assert out["rc"] == -1, out
    assert len(out["user"]) == 1
    return out["user"][0]


# ---- classes ----------------------------------------------------------------------------

def test_guaranteed_keeps_gpu_gres_and_is_tagged(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:2")))
    assert jd["tres_per_node"] == "gres:gpu:2"
    assert jd["admin_comment"] == "antman:class=guaranteed"
    assert "partition" not in jd and jd["requeue"] == NO_VAL16


def test_opportunistic_rewritten_routed_requeueable_tagged(tmp_path: Path) -> None:
    out = run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2", partition="gpu"))
    jd = accepted(out)
    assert jd["tres_per_node"] == "gres:antman_opp:2"
    assert jd["partition"] == "opportunistic"
    assert jd["requeue"] == 1
    assert jd["admin_comment"] == "antman:class=opportunistic"
    assert "qos" not in jd
    assert any("class opportunistic" in m and "alice" in m for m in out["info"])


def test_opportunistic_asks_for_one_switch_within_the_wait(tmp_path: Path) -> None:
    """Read and set on a real 22.05 slurmctld: unset, both are NO_VAL; set, scontrol shows Switches=1@00:05:00."""
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2", min_nodes=2)))
    assert (jd["req_switch"], jd["wait4switch"]) == (1, 300)
    own = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2", req_switch=2, wait4switch=60)))
    assert (own["req_switch"], own["wait4switch"]) == (2, 60)  # the user's --switches stands
    off = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2"),
                       settings={"opp_switch_wait_s": None}))
    assert (off["req_switch"], off["wait4switch"]) == (NO_VAL, NO_VAL)
    guaranteed = accepted(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:2", min_nodes=2)))
    assert (guaranteed["req_switch"], guaranteed["wait4switch"]) == (NO_VAL, NO_VAL)
    # -w node1,node4 (sbatch sends it compressed): nodes under two switches would wait the whole wait for
    # nothing; one named node is under one switch anyway.
    named = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2", min_nodes=2,
                                        req_nodes="node[1,4]")))
    assert (named["req_switch"], named["wait4switch"]) == (NO_VAL, NO_VAL)
    one = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2", min_nodes=1, req_nodes="node3")))
    assert (one["req_switch"], one["wait4switch"]) == (1, 300)


def test_opportunistic_is_kept_on_one_node_unless_it_chose_its_nodes(tmp_path: Path) -> None:
    """Slurm 22.05 spreads --gres=gpu:2 -n 2 over two nodes when no node has the CPUs free (each then
    holds 2 slots: 4 for a job that asked 2); the job stays on one node unless it chose its nodes. Each
    job_desc is as sbatch sent it on the devcluster (logged from slurmctld's Lua)."""
    def max_nodes(**fields: Any) -> Any:
        return accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2", **fields)))["max_nodes"]

    assert max_nodes(num_tasks=2) == 1  # -n 2
    assert max_nodes() == 1
    assert max_nodes(num_tasks=2, ntasks_per_node=2) == 1  # --ntasks-per-node=2: one node's worth
    assert max_nodes(min_nodes=1, req_nodes="node3") == 1  # -w node3
    assert max_nodes(min_nodes=1, max_nodes=1) == 1  # -N 1
    assert max_nodes(min_nodes=2, max_nodes=2) == 2  # -N 2
    assert max_nodes(min_nodes=1, max_nodes=2) == 2  # -N 1-2
    assert max_nodes(min_nodes=2) == NO_VAL  # -w node1,node2
    assert max_nodes(req_nodes="node[1-2]") == NO_VAL  # a node list without its count
    assert max_nodes(req_nodes="node1,node3") == NO_VAL
    assert max_nodes(num_tasks=4, ntasks_per_node=2) == NO_VAL  # -n 4 --ntasks-per-node=2: two nodes
    assert max_nodes(bitflags=256 + 4) == NO_VAL  # --spread-job (SPREAD_JOB, bit 8), beside another flag
    assert max_nodes(bitflags=4) == 1
    # A guaranteed job's placement is Slurm's own.
    g = accepted(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:2", num_tasks=2)))
    assert g["max_nodes"] == NO_VAL


def test_a_bad_switch_wait_in_the_settings_rejects_naming_it(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1"),
                       settings={"opp_switch_wait_s": -5}))
    assert "opp_switch_wait_s" in msg


def test_opportunistic_qos_from_settings(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1", qos="normal"),
                      settings={"opp_qos": "scavenger"}))
    assert jd["qos"] == "scavenger"


def test_class_entry_at_index_zero_is_found(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc(tres_per_node="gres:gpu:1",
                                     spank_job_env=["ANTMAN_CLASS=opportunistic"])))
    assert jd["tres_per_node"] == "gres:antman_opp:1"


TYPED = {"gpu_types": {"a100": 4, "h100": 8}}


@pytest.mark.parametrize("fields, slots", [
    ({"tres_per_node": "gres:gpu:a100:2"}, "gres:antman_opp:a100:2"),
    ({"tres_per_node": "gres/gpu:h100:8"}, "gres/antman_opp:h100:8"),  # the h100 nodes have 8
    ({"tres_per_node": "gres:gpu:h100"}, "gres:antman_opp:h100:1"),
    ({"tres_per_job": "gres:gpu:a100:3"}, "gres:antman_opp:a100:3"),
    ({"tres_per_node": "gres:gpu:a100:1,gres:gpu:1"}, "gres:antman_opp:a100:2"),  # one node: all a100
    # srun --antman=opportunistic --gres=gpu:h100:1 outside a job: cli_filter wrote the typed slots
    ({"tres_per_node": "gres:antman_opp:h100:1"}, "gres:antman_opp:h100:1"),
])
def test_typed_gres_keeps_its_type_on_the_slots(tmp_path: Path, fields: dict[str, Any], slots: str) -> None:
    """Only nodes of that type offer antman_opp:TYPE, so Slurm places the job on one of them."""
    out = run(tmp_path, desc("opportunistic", **fields), settings=TYPED)
    assert accepted(out)["tres_per_node"] == slots
    assert any(f"-> {slots}" in m for m in out["info"]), out["info"]


def test_typed_guaranteed_is_left_to_slurm(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:h100:2"), settings=TYPED))
    assert jd["tres_per_node"] == "gres:gpu:h100:2"


@pytest.mark.parametrize("settings, fields, words", [
    (TYPED, {"tres_per_node": "gres:gpu:v100:1"}, ["no GPU node of this cluster has type v100",
                                                   "(--gres=gpu:v100:1)", "the types are: a100, h100"]),
    ({"gpu_types": {}}, {"tres_per_node": "gres:gpu:a100:1"}, ["no GPU node of this cluster has a declared type",
                                               "ask for --gres=gpu:N"]),
    (TYPED, {"tres_per_node": "gres:gpu:a100:1,gres:gpu:h100:1"},
     ["GPUs of one type", "a100 and h100", "(--gres=gpu:a100:1 --gres=gpu:h100:1)"]),
    (TYPED, {"tres_per_node": "gres:gpu:a100:5"},
     ["at most 4 GPUs per node (the largest a100 node has 4)", "asks for 5", "--gres=gpu:a100:N"]),
])
def test_typed_opportunistic_request_that_cannot_run_is_refused(tmp_path: Path, settings: dict[str, Any],
                                                                fields: dict[str, Any], words: list[str]) -> None:
    msg = rejected(run(tmp_path, desc("opportunistic", **fields), settings=settings))
    for w in words:
        assert w in msg, msg


def test_untyped_request_on_typed_nodes_takes_the_largest_node(tmp_path: Path) -> None:
    out = run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:8"), settings={**TYPED, "max_node_gpus": 8})
    assert accepted(out)["tres_per_node"] == "gres:antman_opp:8"


@pytest.mark.parametrize("value, words", [
    ('"h100"', "field gpu_types must be a table"),
    ('{ h100 = 0 }', "field gpu_types.h100 must be a positive whole number of GPUs, got 0"),
    ('{ h100 = 2.5 }', "gpu_types.h100 must be a positive whole number"),
    ('{ ["h1:00"] = 2 }', 'field gpu_types has the key "h1:00"'),
])
def test_bad_gpu_types_setting_named(tmp_path: Path, value: str, words: str) -> None:
    text = ('return { gpu_gres = "gpu", opp_gres = "antman_opp", guaranteed_partition = "gpu", '
            f'opp_partition = "opportunistic", max_node_gpus = 4, gpu_types = {value} }}\n')
    msg = rejected(run(tmp_path, desc(), settings_text=text))
    assert words in msg and "every job is rejected" in msg


def test_gres_without_count_means_one(tmp_path: Path) -> None:
    assert accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu")))["tres_per_node"] \
        == "gres:antman_opp:1"


def test_other_gres_kept(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1,gres:nic:1")))
    assert sorted(jd["tres_per_node"].split(",")) == ["gres:antman_opp:1", "gres:nic:1"]


def test_per_gpu_options_follow_the_rewrite(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2",
                                     cpus_per_tres="gres:gpu:4", mem_per_tres="gres:gpu:1000")))
    assert jd["cpus_per_tres"] == "gres:antman_opp:4"
    assert jd["mem_per_tres"] == "gres:antman_opp:1000"


# ---- Slurm 24.11 writes TRES as "gres/gpu:2" (22.05: "gres:gpu:2") ---------------------------

def test_slurm24_tres_form_is_read_and_written_back_in_the_same_form(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres/gpu:2,gres/nic:1",
                                     cpus_per_tres="gres/gpu:4", mem_per_tres="gres/gpu:1000")))
    assert sorted(jd["tres_per_node"].split(",")) == ["gres/antman_opp:2", "gres/nic:1"]
    assert jd["cpus_per_tres"] == "gres/antman_opp:4"
    assert jd["mem_per_tres"] == "gres/antman_opp:1000"


def test_slurm24_gpus_per_job_becomes_per_node_in_its_form(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_job="gres/gpu:3")))
    assert jd["tres_per_node"] == "gres/antman_opp:3"


def test_slurm24_guaranteed_may_not_take_opp_gres(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc("guaranteed", tres_per_node="gres/antman_opp:1")))
    assert "antman_opp" in msg and "opportunistic" in msg


# ---- --gpus / --gpus-per-task / --gpus-per-socket -----------------------------------------

def test_gpus_per_job_single_node_becomes_per_node(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_job="gres:gpu:2")))
    assert "tres_per_job" not in jd  # "" clears the field in 22.05
    assert jd["tres_per_node"] == "gres:antman_opp:2"
    assert jd["max_nodes"] == 1


def test_gpus_per_job_multi_node_rejected_naming_gres(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc("opportunistic", tres_per_job="gres:gpu:4", min_nodes=2, max_nodes=2)))
    assert "--gpus" in msg and "--gres=gpu:N" in msg


def test_gpus_per_task_multiplies_by_tasks(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_task="gres:gpu:1", num_tasks=3,
                                     min_nodes=1, max_nodes=1)))
    assert jd["tres_per_node"] == "gres:antman_opp:3"
    assert "tres_per_task" not in jd


def test_gpus_per_socket(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_socket="gres:gpu:1", sockets_per_node=2)))
    assert jd["tres_per_node"] == "gres:antman_opp:2"
    msg = rejected(run(tmp_path, desc("opportunistic", tres_per_socket="gres:gpu:1")))
    assert "--sockets-per-node" in msg


def test_gpus_asked_two_ways_rejected(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1", tres_per_job="gres:gpu:2")))
    assert "two ways" in msg and "--gpus" in msg


def test_ntasks_per_gpu_rejected_for_opportunistic(tmp_path: Path) -> None:
    assert "--ntasks-per-gpu" in rejected(run(tmp_path, desc("opportunistic", tres_per_job="gres:gpu:1",
                                                             ntasks_per_tres=1)))


def test_opportunistic_without_gpus_rejected(tmp_path: Path) -> None:
    assert "--gres=gpu:N" in rejected(run(tmp_path, desc("opportunistic")))


# ---- no flag, auto, unknown ------------------------------------------------------------

def test_no_flag_default_none_untouched(tmp_path: Path) -> None:
    before = desc(tres_per_node="gres:gpu:2")
    jd = accepted(run(tmp_path, before))
    assert jd == {k: v for k, v in before.items()}


def test_no_flag_default_guaranteed(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc(tres_per_node="gres:gpu:1"), settings={"default_class": "guaranteed"}))
    assert jd["admin_comment"] == "antman:class=guaranteed" and jd["tres_per_node"] == "gres:gpu:1"


def test_no_flag_default_opportunistic(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc(tres_per_node="gres:gpu:1"), settings={"default_class": "opportunistic"}))
    assert jd["admin_comment"] == "antman:class=opportunistic" and jd["tres_per_node"] == "gres:antman_opp:1"


def test_no_flag_cpu_job_stays_plain_under_any_default(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc(), settings={"default_class": "opportunistic"}))
    assert "admin_comment" not in jd and "partition" not in jd


def test_auto_uses_auto_class_and_records_the_request(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("auto", tres_per_node="gres:gpu:1"), settings={"auto_class": "opportunistic"}))
    assert jd["admin_comment"] == "antman:class=opportunistic;req=auto"
    jd = accepted(run(tmp_path, desc("auto", tres_per_node="gres:gpu:1")))
    assert jd["admin_comment"] == "antman:class=guaranteed;req=auto"


def test_explicit_class_has_no_req_field(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:1")))
    assert jd["admin_comment"] == "antman:class=guaranteed"


def test_auto_without_auto_class_follows_architecture_rule(tmp_path: Path) -> None:
    s = dict(SETTINGS, default_class="opportunistic")
    del s["auto_class"]
    jd = accepted(run(tmp_path, desc("auto", tres_per_node="gres:gpu:1"),
                      settings_text="return " + lua_literal(s)))
    assert jd["admin_comment"] == "antman:class=opportunistic;req=auto"


def test_unknown_class_rejected_naming_allowed_values(tmp_path: Path) -> None:
    out = run(tmp_path, desc("premium", tres_per_node="gres:gpu:1"))
    msg = rejected(out)
    assert "premium" in msg and "guaranteed, opportunistic, auto" in msg
    assert "admin_comment" not in out["job_desc"]


def test_class_none_may_not_take_opp_gres_directly(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc(tres_per_node="gres:antman_opp:1")))
    assert "antman_opp" in msg and "--antman=opportunistic" in msg


# ---- partitions --------------------------------------------------------------------------

@pytest.mark.parametrize("partition", ["opportunistic", "gpu,opportunistic"])
def test_guaranteed_asking_for_opp_partition_rejected(tmp_path: Path, partition: str) -> None:
    msg = rejected(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:1", partition=partition)))
    assert "guaranteed jobs cannot use the opportunistic partition" in msg


def test_opportunistic_routed_from_any_partition(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1", partition="gpu,debug"),
                      settings={"opp_partition": "scavenge"}))
    assert jd["partition"] == "scavenge"


# ---- settings and internal errors ----------------------------------------------------------

def test_missing_settings_rejects_every_job(tmp_path: Path) -> None:
    for jd in (desc(), desc("guaranteed", tres_per_node="gres:gpu:1")):
        out = run(tmp_path, jd, settings={})
        msg = rejected(out)
        assert "antman_settings.lua" in msg and "every job is rejected" in msg


def test_broken_settings_file_rejects(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc(), settings_text="return { default_class = "))
    assert "antman_settings.lua" in msg


def test_bad_settings_value_names_the_field(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc(), settings={"default_class": "sometimes"}))
    assert "default_class" in msg and "none, guaranteed, opportunistic" in msg
    msg = rejected(run(tmp_path, desc(), settings={"opp_gres": "gpu"}))
    assert "gpu_gres and opp_gres must differ" in msg


def test_settings_cannot_reach_slurm_or_os(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc(), settings_text="os.exit(3)\nreturn {}"))
    assert "error in settings" in msg


@pytest.mark.parametrize("fields", [
    {"tres_per_node": {"oops": 1}},
    {"spank_job_env": "ANTMAN_CLASS=opportunistic"},
])
def test_internal_error_rejects_instead_of_passing(tmp_path: Path, fields: dict[str, Any]) -> None:
    jd = desc(**fields)
    if "spank_job_env" not in fields:
        jd["spank_job_env"] = ["ANTMAN_CLASS=opportunistic"]
    out = run(tmp_path, jd)
    msg = rejected(out)
    assert msg.startswith("slurm-antman: internal error classifying job:")
    assert msg.endswith("job rejected, contact your admin")
    assert "admin_comment" not in out["job_desc"]


# ---- slurm_job_modify ----------------------------------------------------------------------

OPP_REC = {"job_id": 42, "admin_comment": "antman:class=opportunistic;gpus=n1:0",
           "partition": "opportunistic", "tres_per_node": "gres:antman_opp:1"}


ACCESS_DENIED = 2002  # slurm.ESLURM_ACCESS_DENIED in the harness


def refused(out: dict[str, Any], rc: int = ACCESS_DENIED) -> str:
    """A refused update: 22.05 drops log_user text on modify, so the reason is in the ctld log."""
    assert out["rc"] == rc, out
    assert out["user"] == []
    reasons = [m for m in out["info"] if "rejected update of job" in m]
    assert len(reasons) == 1, out["info"]
    return reasons[0]


def modify(tmp_path: Path, job_rec: dict[str, Any], uid: int = 1000, **changes: Any) -> dict[str, Any]:
    return run(tmp_path, desc(**changes), call="modify", job_rec=job_rec, uid=uid)


@pytest.mark.parametrize("changes", [
    {"tres_per_node": "gres:gpu:1"},
    {"tres_per_node": "gres:gpu:a100:1,gres:nic:1"},
    {"tres_per_job": "gpu:1"},  # scontrol update TresPerJob= arrives without "gres:"
    {"tres_per_task": "gres:gpu:1"},
])
def test_modify_opportunistic_onto_gpu_gres_rejected(tmp_path: Path, changes: dict[str, Any]) -> None:
    msg = refused(modify(tmp_path, OPP_REC, **changes))
    assert "job 42 is opportunistic" in msg and "physical gpu GRES" in msg


def test_modify_opportunistic_onto_guaranteed_partition_rejected(tmp_path: Path) -> None:
    msg = refused(modify(tmp_path, OPP_REC, partition="gpu"))
    assert "cannot be moved to the gpu partition" in msg


def test_modify_opportunistic_requeue_off_rejected(tmp_path: Path) -> None:
    assert "requeueable" in refused(modify(tmp_path, OPP_REC, requeue=0))


@pytest.mark.parametrize("changes", [
    {"time_limit": 60},
    {"tres_per_node": "gres:antman_opp:2"},
    {"partition": "debug"},
])
def test_modify_opportunistic_other_changes_pass(tmp_path: Path, changes: dict[str, Any]) -> None:
    accepted(modify(tmp_path, OPP_REC, **changes))


@pytest.mark.parametrize("job_rec", [
    {"job_id": 7, "admin_comment": "antman:class=guaranteed"},
    {"job_id": 8},
])
def test_modify_non_opportunistic_passes(tmp_path: Path, job_rec: dict[str, Any]) -> None:
    accepted(modify(tmp_path, job_rec, tres_per_node="gres:gpu:2", partition="gpu"))


def test_modify_root_upgrade_passes_user_does_not(tmp_path: Path) -> None:
    up = {"tres_per_node": "gres:gpu:1", "partition": "gpu", "admin_comment": "antman:class=guaranteed"}
    accepted(modify(tmp_path, OPP_REC, uid=0, **up))
    refused(modify(tmp_path, OPP_REC, uid=1000, **up))


def test_modify_missing_settings_rejected(tmp_path: Path) -> None:
    out = run(tmp_path, desc(time_limit=5), settings={}, call="modify", job_rec=OPP_REC)
    assert "antman_settings.lua" in refused(out, rc=-1)


def test_modify_of_other_jobs_passes_without_settings(tmp_path: Path) -> None:
    out = run(tmp_path, desc(time_limit=5), settings={}, call="modify",
              job_rec={"job_id": 9, "admin_comment": "antman:class=guaranteed"})
    accepted(out)


def test_auto_resolved_by_coordinator_quota_file(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "antman_quota.lua").write_text(
        'return { accounts = { ["research"] = { quota = 2, used = 1 }, ["product"] = { quota = 1, used = 1 } } }\n')
    jd = accepted(run(tmp_path, desc("auto", tres_per_node="gres:gpu:1", account="research")))
    assert jd["admin_comment"] == "antman:class=guaranteed;req=auto"
    jd = accepted(run(tmp_path, desc("auto", tres_per_node="gres:gpu:2", account="research")))
    assert jd["admin_comment"] == "antman:class=opportunistic;req=auto" and jd["tres_per_node"] == "gres:antman_opp:2"
    jd = accepted(run(tmp_path, desc("auto", tres_per_node="gres:gpu:1", account="product")))
    assert jd["admin_comment"] == "antman:class=opportunistic;req=auto"
    # an account the file does not list falls back to the site's auto_class
    jd = accepted(run(tmp_path, desc("auto", tres_per_node="gres:gpu:1", account="other")))
    assert jd["admin_comment"] == "antman:class=guaranteed;req=auto"


def test_auto_uses_the_default_account_when_none_is_given(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "antman_quota.lua").write_text(
        'return { accounts = { ["research"] = { quota = 1, used = 1 } } }\n')
    out = run(tmp_path, desc("auto", tres_per_node="gres:gpu:1", default_account="research"))
    assert accepted(out)["admin_comment"] == "antman:class=opportunistic;req=auto"
    assert any("tenant research over quota" in m for m in out["info"])


# ---- opportunistic GPUs per node against the largest node ------------------------------------

@pytest.mark.parametrize("fields, option", [
    ({"tres_per_node": "gres:gpu:5"}, "--gres=gpu:5"),
    ({"tres_per_node": "gres/gpu:5"}, "--gres=gpu:5"),
    ({"tres_per_job": "gres:gpu:6"}, "--gpus=gpu:6"),
    ({"tres_per_task": "gres:gpu:2", "num_tasks": 3}, "--gpus-per-task=gpu:2 x 3"),
])
def test_opportunistic_larger_than_any_node_rejected(tmp_path: Path, fields: dict[str, Any], option: str) -> None:
    msg = rejected(run(tmp_path, desc("opportunistic", **fields)))
    assert "at most 4 GPUs per node (the largest node has 4)" in msg
    assert f"({option})" in msg, msg
    assert f"asks for {5 if '5' in option else 6}" in msg


def test_opportunistic_at_the_node_size_and_auto_over_it(tmp_path: Path) -> None:
    assert accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:4")))["tres_per_node"] == \
        "gres:antman_opp:4"
    # auto that resolves to opportunistic meets the same limit
    msg = rejected(run(tmp_path, desc("auto", tres_per_node="gres:gpu:5"), settings={"auto_class": "opportunistic"}))
    assert "asks for 5 (--gres=gpu:5)" in msg
    # the limit is the setting, not a constant
    assert accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:5"), settings={"max_node_gpus": 8}))


def test_settings_without_max_node_gpus_tell_the_admin_to_render(tmp_path: Path) -> None:
    s = dict(SETTINGS)
    del s["max_node_gpus"]
    msg = rejected(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:1"),
                       settings_text="return " + lua_literal(s)))
    assert "max_node_gpus is missing" in msg and "antman config render" in msg and "every job is rejected" in msg


@pytest.mark.parametrize("value", [0, 2.5, "4"])
def test_bad_max_node_gpus_named(tmp_path: Path, value: Any) -> None:
    msg = rejected(run(tmp_path, desc(), settings={"max_node_gpus": value}))
    assert "max_node_gpus must be a positive whole number" in msg


# ---- heterogeneous jobs -------------------------------------------------------------------

@pytest.mark.parametrize("cls", ["guaranteed", "opportunistic", "auto"])
@pytest.mark.parametrize("offset", [0, 1])
def test_het_job_component_rejected_for_every_class(tmp_path: Path, cls: str, offset: int) -> None:
    out = run(tmp_path, desc(cls, tres_per_node="gres:gpu:1", het_job_offset=offset))
    msg = rejected(out)
    assert msg == ("slurm-antman: heterogeneous jobs are not supported by slurm-antman "
                   f"(component {offset} of a --het-group/':' job); submit the components as separate jobs "
                   "or without --antman")
    assert "admin_comment" not in out["job_desc"]


def test_het_job_by_default_class_says_it_is_the_site_default(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, desc(tres_per_node="gres:gpu:1", het_job_offset=2),
                       settings={"default_class": "opportunistic"}))
    assert "component 2" in msg and "makes GPU jobs opportunistic by default" in msg


def test_het_job_without_a_class_untouched(tmp_path: Path) -> None:
    before = desc(tres_per_node="gres:gpu:1", het_job_offset=1)
    assert accepted(run(tmp_path, before)) == before
    # a CPU-only component under a GPU default class has nothing to share either
    assert "admin_comment" not in accepted(run(tmp_path, desc(het_job_offset=1),
                                               settings={"default_class": "guaranteed"}))


def test_not_a_het_job_passes(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:1", het_job_offset=NO_VAL)))
    assert jd["admin_comment"] == "antman:class=guaranteed"


# ---- auto admissions between two quota files ----------------------------------------------

def quota_text(used: int, quota: int = 4, as_of: Optional[float] = None, account: str = "research") -> str:
    head = f"as_of = {as_of!r}, " if as_of is not None else ""
    return f'return {{ {head}accounts = {{ ["{account}"] = {{ quota = {quota}, used = {used} }} }} }}\n'


def auto(account: str = "research", gpus: int = 1, now: int = 1000, cls: str = "auto") -> dict[str, Any]:
    return {"job_desc": desc(cls, tres_per_node=f"gres:gpu:{gpus}", account=account), "now": now}


def classes(results: list[dict[str, Any]]) -> list[str]:
    return [accepted(r)["admin_comment"].split(";")[0].split("=")[1] for r in results]


def test_auto_burst_within_one_cycle_admits_exactly_the_quota(tmp_path: Path) -> None:
    steps = [{"write": "antman_quota.lua", "text": quota_text(0, as_of=999.5)}] + [auto() for _ in range(6)]
    out = run_steps(tmp_path, steps)
    assert classes(out) == ["guaranteed"] * 4 + ["opportunistic"] * 2
    assert "3 of 4 GPUs in use (0 in the coordinator's count, 3 admitted since)" in out[3]["info"][-2]


def test_auto_counts_gpus_and_accounts_separately(tmp_path: Path) -> None:
    two = ('return { as_of = 999.0, accounts = { ["research"] = { quota = 4, used = 1 }, '
           '["product"] = { quota = 2, used = 0 } } }\n')
    out = run_steps(tmp_path, [{"write": "antman_quota.lua", "text": two},
                               auto(gpus=2), auto(gpus=2), auto("product", gpus=2), auto(gpus=1),
                               auto("product", gpus=1)])
    assert classes(out) == ["guaranteed", "opportunistic", "guaranteed", "guaranteed", "opportunistic"]


def test_explicit_guaranteed_takes_quota_from_auto(tmp_path: Path) -> None:
    out = run_steps(tmp_path, [{"write": "antman_quota.lua", "text": quota_text(1, as_of=1000.0)},
                               auto(gpus=2, cls="guaranteed"), auto(), auto()])
    assert classes(out) == ["guaranteed", "guaranteed", "opportunistic"]


def test_newer_quota_file_replaces_the_admissions_it_has_seen(tmp_path: Path) -> None:
    steps = [{"write": "antman_quota.lua", "text": quota_text(0, as_of=999.9)}] + [auto() for _ in range(4)]
    # A file written within the margin (5 s) of the admissions may have missed them: still counted.
    steps += [{"write": "antman_quota.lua", "text": quota_text(2, as_of=1005.5)}, auto(now=1006)]
    # A snapshot taken after the admissions' second plus the margin has them (here: two have ended).
    steps += [{"write": "antman_quota.lua", "text": quota_text(2, as_of=1006.0)},
              auto(now=1007), auto(now=1007), auto(now=1007)]
    out = run_steps(tmp_path, steps)
    assert classes(out) == ["guaranteed"] * 4 + ["opportunistic"] + ["guaranteed"] * 2 + ["opportunistic"]
    assert "6 of 4 GPUs in use (2 in the coordinator's count, 4 admitted since)" in out[4]["info"][-2]


def test_quota_file_without_as_of_counts_the_last_two_minutes(tmp_path: Path) -> None:
    """A coordinator from before as_of: its file says nothing of when it looked, so every admission
    within the longest possible cycle is assumed missing from it."""
    steps = [{"write": "antman_quota.lua", "text": quota_text(0)}, auto(gpus=4, now=1000),
             auto(now=1119), auto(now=1121)]
    assert classes(run_steps(tmp_path, steps)) == ["guaranteed", "opportunistic", "guaranteed"]


def test_het_auto_component_takes_no_quota(tmp_path: Path) -> None:
    het = auto(gpus=4)
    het["job_desc"]["het_job_offset"] = 0
    out = run_steps(tmp_path, [{"write": "antman_quota.lua", "text": quota_text(0, as_of=1000.0)}, het, auto(gpus=4)])
    assert out[0]["rc"] == -1 and "heterogeneous" in out[0]["user"][0]
    assert classes(out[1:]) == ["guaranteed"]


def test_the_coordinators_quota_file_is_read_with_its_as_of(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from slurm_antman.coordinator.daemon import quota_lua
    from slurm_antman.policy.cluster.model import JobView

    running = JobView("1", "research", "ann", "RUNNING", "guaranteed", "guaranteed", 2, "n1", 0.0, 1.0, 0, None, False)
    text = quota_lua(SimpleNamespace(jobs=(running,), quotas={"research": 4}), 1000.25)
    out = run_steps(tmp_path, [{"write": "antman_quota.lua", "text": text}, auto(now=1003), auto(now=1003),
                               auto(now=1003)])
    assert classes(out) == ["guaranteed", "guaranteed", "opportunistic"]
    assert "4 of 4 GPUs in use (2 in the coordinator's count, 2 admitted since)" in out[2]["info"][-2]


def test_rendered_settings_carry_the_largest_node(tmp_path: Path) -> None:
    from slurm_antman import config
    from slurm_antman.admin.render import render_all

    cfg = config.parse({"nodes": [{"name": "a[1-2]", "gpus": 8}, {"name": "b1", "gpus": 2}]})
    text = render_all(cfg)["antman_settings.lua"]
    assert accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:8"), settings_text=text))
    msg = rejected(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:9"), settings_text=text))
    assert "at most 8 GPUs per node (the largest node has 8); this one asks for 9 (--gres=gpu:9)" in msg


# ---- a site's own job_submit.lua with the module chained in -------------------------------

DAY, WEEK = 24 * 60, 7 * 24 * 60
ANTMAN_LINE = ('dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. '
               '"antman_job_submit.lua").chain()\n')


def test_the_plain_script_is_the_one_line_a_site_adds() -> None:
    lines = [l for l in SCRIPT.read_text().splitlines() if l and not l.startswith("--")]
    assert lines == [ANTMAN_LINE.strip()]
    assert ANTMAN_LINE in SITE_SCRIPT.read_text()


def test_site_example_rules_then_antman(tmp_path: Path) -> None:
    out = run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1", time_limit=NO_VAL), script=SITE_SCRIPT)
    jd = accepted(out)
    assert jd["time_limit"] == DAY  # the site's rule
    assert jd["tres_per_node"] == "gres:antman_opp:1" and jd["partition"] == "opportunistic"  # antman's
    assert jd["admin_comment"] == "antman:class=opportunistic"
    jd = accepted(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:2", time_limit=60), script=SITE_SCRIPT))
    assert jd["time_limit"] == 60 and jd["admin_comment"] == "antman:class=guaranteed"
    jd = accepted(run(tmp_path, desc(tres_per_node="gres:gpu:1"), script=SITE_SCRIPT))
    assert jd["time_limit"] == DAY and "admin_comment" not in jd  # plain Slurm job: the site's rule only


def test_site_refusal_is_the_sites_and_antman_never_runs(tmp_path: Path) -> None:
    out = run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1", time_limit=WEEK + 1), script=SITE_SCRIPT)
    assert out["rc"] == -1
    assert out["user"] == [f"site policy: a job may run at most 7 days (--time=7-0); this one asks for {WEEK + 1} minutes"]
    assert "admin_comment" not in out["job_desc"] and out["job_desc"]["tres_per_node"] == "gres:gpu:1"
    # antman's own refusals still reach the user through the chain
    msg = rejected(run(tmp_path, desc("guaranteed", partition="opportunistic", tres_per_node="gres:gpu:1"),
                       script=SITE_SCRIPT))
    assert msg.startswith("slurm-antman: guaranteed jobs cannot use the opportunistic partition")


def test_a_job_the_site_refuses_takes_no_quota(tmp_path: Path) -> None:
    """Why antman runs after the site: had it admitted the guaranteed job first, the site's refusal would
    leave that admission counted against the tenant, and the next auto job would go opportunistic."""
    too_long = auto(gpus=1, cls="guaranteed")
    too_long["job_desc"]["time_limit"] = 2 * WEEK
    out = run_steps(tmp_path, [{"write": "antman_quota.lua", "text": quota_text(0, quota=1, as_of=999.5)},
                               too_long, auto()], script=SITE_SCRIPT)
    assert out[0]["rc"] == -1 and out[0]["user"][0].startswith("site policy:")
    assert classes(out[1:]) == ["guaranteed"]


def test_site_modify_rule_then_antmans_guard(tmp_path: Path) -> None:
    longer = run(tmp_path, desc(time_limit=WEEK + 60), call="modify", job_rec={"job_id": 7}, script=SITE_SCRIPT)
    assert longer["rc"] == -1 and any("user 1000 may not raise job 7's time limit" in m for m in longer["info"])
    as_root = run(tmp_path, desc(time_limit=WEEK + 60), call="modify", job_rec={"job_id": 7}, uid=0,
                  script=SITE_SCRIPT)
    assert as_root["rc"] == 0, as_root
    # the site lets this update through; antman's guard of opportunistic jobs still refuses it
    msg = refused(modify_with(tmp_path, SITE_SCRIPT, OPP_REC, partition="gpu"))
    assert "job 42 is opportunistic" in msg and "cannot be moved to the gpu partition" in msg


def modify_with(tmp_path: Path, script: Path | str, job_rec: dict[str, Any], uid: int = 1000, **changes: Any):
    return run(tmp_path, desc(**changes), call="modify", job_rec=job_rec, uid=uid, script=script)


SITE_AFTER = ANTMAN_LINE + '''
-- defined after the line: chain() must still take them (a metatable on _G catches the definitions)
function slurm_job_submit(job_desc, part_list, submit_uid)
  -- a site rule that sends every job to its default partition: antman routes opportunistic jobs after it
  job_desc.partition = "gpu"
  job_desc.comment = "site was here"
  return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
helper_global = 42  -- other globals of the site's script are untouched
return slurm.SUCCESS
'''


def test_site_functions_defined_after_the_line_are_chained(tmp_path: Path) -> None:
    out = run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1"), script=SITE_AFTER)
    jd = accepted(out)
    assert jd["comment"] == "site was here"
    assert jd["partition"] == "opportunistic" and jd["tres_per_node"] == "gres:antman_opp:1"
    jd = accepted(run(tmp_path, desc(tres_per_node="gres:gpu:1"), script=SITE_AFTER))
    assert jd["partition"] == "gpu" and jd["comment"] == "site was here" and "admin_comment" not in jd


@pytest.mark.parametrize("body, rc", [
    ('error("boom in the site rule")', -1),
    ("local x = nil; return x.field", -1),
])
def test_an_error_in_the_sites_function_rejects_the_job(tmp_path: Path, body: str, rc: int) -> None:
    script = f"function slurm_job_submit(j, p, u) {body} end\nfunction slurm_job_modify() return 0 end\n" + ANTMAN_LINE
    out = run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1"), script=script)
    assert out["rc"] == rc
    assert out["user"] == ["job_submit.lua failed on this job (an error in the site's own rules); job rejected, "
                           "contact your admin"]
    assert any("the site's slurm_job_submit raised an error" in m for m in out["error"]), out
    assert "admin_comment" not in out["job_desc"]


def test_site_function_returning_nothing_counts_as_success(tmp_path: Path) -> None:
    """job_submit/lua reads a non-numeric return as success ("non-numeric return code")."""
    script = "function slurm_job_submit(j, p, u) j.comment = 'x' end\nfunction slurm_job_modify() end\n" + ANTMAN_LINE
    jd = accepted(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:1"), script=script))
    assert jd["comment"] == "x" and jd["admin_comment"] == "antman:class=guaranteed"


def test_explicit_call_instead_of_chain(tmp_path: Path) -> None:
    script = ('local antman = dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. '
              '"antman_job_submit.lua")\n'
              "function slurm_job_submit(j, p, u)\n"
              "  local rc = antman.job_submit(j, p, u)\n"
              "  if rc == slurm.SUCCESS then j.comment = 'after antman: ' .. tostring(j.admin_comment) end\n"
              "  return rc\nend\n"
              "function slurm_job_modify(j, r, p, u) return antman.job_modify(j, r, p, u) end\n")
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1"), script=script))
    assert jd["comment"] == "after antman: antman:class=opportunistic"
    assert refused(modify_with(tmp_path, script, OPP_REC, tres_per_node="gres:gpu:1"))


def test_chain_twice_runs_the_policy_once(tmp_path: Path) -> None:
    script = ("function slurm_job_submit(j) j.comment = (j.comment or '') .. 'site;' return 0 end\n"
              "function slurm_job_modify() return 0 end\n" + ANTMAN_LINE + ANTMAN_LINE)
    out = run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:1"), script=script)
    jd = accepted(out)
    assert jd["comment"] == "site;" and jd["tres_per_node"] == "gres:antman_opp:1"
    assert sum("class opportunistic" in m for m in out["info"]) == 1


EXPLICIT_CALL = ('local antman = dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. '
                 '"antman_job_submit.lua")\n'
                 "function slurm_job_submit(j, p, u) return antman.job_submit(j, p, u) end\n"
                 "function slurm_job_modify(j, r, p, u) return antman.job_modify(j, r, p, u) end\n")


def test_missing_loader_rejects_every_job_naming_it(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "antman_settings_loader.lua").write_text("return 42\n")
    msg = rejected(run(tmp_path, desc("guaranteed", tres_per_node="gres:gpu:1"), script=EXPLICIT_CALL))
    assert "antman_settings_loader.lua" in msg and "every job is rejected" in msg


def test_chain_without_the_loader_still_loads_and_rejects_every_job(tmp_path: Path) -> None:
    """chain() is the loader's. Without it job_submit.lua must still load (a script that does not load is
    fatal at slurmctld's start), reject every job naming the file, and not let a site function defined
    after the line replace the policy."""
    d = tmp_path / "etc"
    d.mkdir()
    (d / "job_submit.lua").write_text(
        'dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "antman_job_submit.lua").chain()\n'
        "function slurm_job_submit(j, p, u) return slurm.SUCCESS end  -- after the line: must not take over\n")
    shutil.copy(ROOT / "etc" / "antman_job_submit.lua", d / "antman_job_submit.lua")
    (d / "antman_settings_loader.lua").write_text("return 42\n")
    case = tmp_path / "case.lua"
    case.write_text("return " + lua_literal({"call": "submit", "job_desc": desc("guaranteed")}) + "\n")
    proc = subprocess.run([LUA, str(HARNESS), str(d / "job_submit.lua"), str(case)],
                          capture_output=True, text=True, timeout=20)
    out = json.loads(proc.stdout)
    assert not out.get("load_error"), out
    assert out["rc"] == -1 and "antman_settings_loader.lua" in " ".join(out["user"]), out
