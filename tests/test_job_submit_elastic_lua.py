"""job_submit.lua and --antman-elastic=MIN:MAX (docs/elastic.md), under lua5.1 with
tests/lua/harness.lua standing in for slurmctld (the helpers of test_job_submit_lua.py).

The SPANK plugin checks the value alone; the script checks it again (a client can put ANTMAN_ELASTIC
into the job control env without the plugin) together with what only the whole request tells: the
class, the GPUs per node, the nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest

from test_job_submit_lua import LUA, NO_VAL, accepted, desc, rejected, run

pytestmark = pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed (apt-get install lua5.1)")


def edesc(cls: Optional[str], elastic: str, **fields: Any) -> dict[str, Any]:
    """A job_desc as sbatch sends it with --antman=CLS --antman-elastic=ELASTIC (cls None: no --antman)."""
    d = desc(cls, **fields)
    env = list(d.get("spank_job_env", []))
    env += [f"_SLURM_SPANK_OPTION_antman_antman-elastic={elastic}", f"ANTMAN_ELASTIC={elastic}"]
    d["spank_job_env"] = env
    return d


# ---- accepted ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tres, field", [
    ("gres:gpu:2", "tres_per_node"),   # 22.05
    ("gres/gpu:2", "tres_per_node"),   # 24.11
    ("gres:gpu:2", "tres_per_job"),    # --gpus=2, one node
])
def test_opportunistic_elastic_is_tagged_and_kept_on_one_node(tmp_path: Path, tres: str, field: str) -> None:
    jd = accepted(run(tmp_path, edesc("opportunistic", "1:2", **{field: tres})))
    assert jd["admin_comment"] == "antman:class=opportunistic;elastic=1:2"
    assert jd["tres_per_node"].endswith("antman_opp:2")
    assert jd["max_nodes"] == 1 and jd["partition"] == "opportunistic" and jd["requeue"] == 1


def test_elastic_with_n_1_and_typed_gpus(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, edesc("opportunistic", "2:4", tres_per_node="gres:gpu:4", min_nodes=1, max_nodes=1)))
    assert jd["admin_comment"] == "antman:class=opportunistic;elastic=2:4" and jd["max_nodes"] == 1
    # four tasks of one GPU each on one node: --gpus-per-task=1 -n 4 is four GPUs per node
    jd = accepted(run(tmp_path, edesc("opportunistic", "4:4", tres_per_task="gres:gpu:1", num_tasks=4)))
    assert jd["admin_comment"] == "antman:class=opportunistic;elastic=4:4"
    assert jd["tres_per_node"] == "gres:antman_opp:4"


def test_elastic_one_to_max_node(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, edesc("opportunistic", "1:4", tres_per_node="gres:gpu:4")))
    assert jd["admin_comment"] == "antman:class=opportunistic;elastic=1:4"


def test_auto_resolved_opportunistic_keeps_the_range_after_req(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, edesc("auto", "1:2", tres_per_node="gres:gpu:2"),
                      settings={"auto_class": "opportunistic"}))
    assert jd["admin_comment"] == "antman:class=opportunistic;req=auto;elastic=1:2"
    assert jd["max_nodes"] == 1


def test_auto_resolved_guaranteed_drops_the_range(tmp_path: Path) -> None:
    out = run(tmp_path, edesc("auto", "1:2", tres_per_node="gres:gpu:2"), settings={"auto_class": "guaranteed"})
    jd = accepted(out)
    assert jd["admin_comment"] == "antman:class=guaranteed;req=auto"
    assert jd["tres_per_node"] == "gres:gpu:2"
    assert any("--antman-elastic=1:2 dropped, the job is guaranteed" in line for line in out["info"]), out["info"]


def test_the_last_value_in_the_env_counts(tmp_path: Path) -> None:
    d = edesc("opportunistic", "1:1", tres_per_node="gres:gpu:2")
    d["spank_job_env"].append("ANTMAN_ELASTIC=2:2")
    assert accepted(run(tmp_path, d))["admin_comment"] == "antman:class=opportunistic;elastic=2:2"


def test_no_elastic_changes_nothing(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, desc("opportunistic", tres_per_node="gres:gpu:2")))
    assert jd["admin_comment"] == "antman:class=opportunistic"
    assert "ANTMAN_ELASTIC" not in str(jd)


# ---- refused -----------------------------------------------------------------------------------

def test_guaranteed_is_refused_naming_the_rule(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, edesc("guaranteed", "1:2", tres_per_node="gres:gpu:2")))
    assert "--antman-elastic" in msg and "--antman=opportunistic" in msg and "guaranteed" in msg
    assert "width is its own" in msg


@pytest.mark.parametrize("default_class", ["none", "opportunistic"])
def test_no_class_is_refused(tmp_path: Path, default_class: str) -> None:
    """Without --antman the option means nothing, even where GPU jobs default to opportunistic: the
    user must say what they ask for."""
    msg = rejected(run(tmp_path, edesc(None, "1:2", tres_per_node="gres:gpu:2"),
                       settings={"default_class": default_class}))
    assert "--antman-elastic" in msg and "names no class" in msg and "--antman=opportunistic" in msg


@pytest.mark.parametrize("value", ["", "2", "3:2", "0:1", "1:65", "65:65", "01:2", "1:02", "1:2:3", "a:b", "-1:2",
                                   "+1:2", " 1:2", "1:2 ", "1-2", ":2", "1:", "100:100", "1:2\n"])
def test_bad_values_are_refused_by_the_script_too(tmp_path: Path, value: str) -> None:
    msg = rejected(run(tmp_path, edesc("opportunistic", value, tres_per_node="gres:gpu:2")))
    assert msg.startswith("slurm-antman: --antman-elastic: invalid value")
    assert "1 <= MIN <= MAX <= 64" in msg


def test_max_must_equal_the_gpus_per_node(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, edesc("opportunistic", "1:3", tres_per_node="gres:gpu:2")))
    assert "--antman-elastic=1:3: MAX must equal the GPUs per node the job asks for, 2 (--gres=gpu:2)" in msg
    assert "--gres=gpu:3" in msg and "--antman-elastic=1:2" in msg
    msg = rejected(run(tmp_path, edesc("opportunistic", "1:1", tres_per_node="gres/gpu:2")))
    assert "MAX must equal" in msg and ", 2 (--gres=gpu:2)" in msg
    # auto is checked before it is resolved: the same request is refused whatever the quota says
    msg = rejected(run(tmp_path, edesc("auto", "1:3", tres_per_node="gres:gpu:2"), settings={"auto_class": "guaranteed"}))
    assert "MAX must equal" in msg


def test_no_gpu_is_refused(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, edesc("opportunistic", "1:2")))
    assert "--antman-elastic=1:2: the job asks for no GPU" in msg and "--gres=gpu:2" in msg


def test_an_unreadable_gpu_count_is_refused(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, edesc("opportunistic", "1:2", tres_per_node="gres:gpu:a:b:c")))
    assert "--antman-elastic=1:2: cannot read the GPU count" in msg and "gpu:a:b:c" in msg


@pytest.mark.parametrize("fields", [
    {"min_nodes": 2, "max_nodes": 2, "tres_per_node": "gres:gpu:2"},            # -N 2
    {"min_nodes": 1, "max_nodes": 2, "tres_per_node": "gres:gpu:2"},            # -N 1-2
    {"req_nodes": "node[1-2]", "tres_per_node": "gres:gpu:2"},                  # -w node[1-2]
    {"num_tasks": 4, "ntasks_per_node": 2, "tres_per_node": "gres:gpu:2"},      # -n 4 --ntasks-per-node=2
    {"bitflags": 256, "tres_per_node": "gres:gpu:2"},                           # --spread-job
])
def test_across_nodes_is_refused_saying_how_to_do_it(tmp_path: Path, fields: dict[str, Any]) -> None:
    """Not an array: one job over several nodes is refused, and told to be a job array of one-node tasks."""
    msg = rejected(run(tmp_path, edesc("opportunistic", "1:2", **fields)))
    assert msg.startswith("slurm-antman: --antman-elastic=1:2: an elastic job runs on one node; for one job across "
                          "K nodes, submit it as a job array of one-node tasks: --array=0-(K-1) with --gres=gpu:G "
                          "per task and --antman-elastic=MIN:MAX, MAX = K x G, MIN a multiple of G"), msg


def test_one_named_node_is_fine(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, edesc("opportunistic", "1:2", req_nodes="node2", tres_per_node="gres:gpu:2")))
    assert jd["admin_comment"] == "antman:class=opportunistic;elastic=1:2" and jd["max_nodes"] == 1


def test_unset_numbers_are_unset(tmp_path: Path) -> None:
    # NO_VAL in min/max nodes is "not given", not "4294967294 nodes"
    jd = accepted(run(tmp_path, edesc("opportunistic", "1:2", min_nodes=NO_VAL, max_nodes=NO_VAL,
                                      tres_per_node="gres:gpu:2")))
    assert jd["max_nodes"] == 1


# ---- job arrays (docs/elastic.md, "Across nodes: a job array") ---------------------------------------
# job_desc.array_inx is the --array value as sbatch sends it, the throttle "%N" included
# (test_cluster_elastic_submit.py checks that on the real slurmctld).

def adesc(elastic: str, array: str, tres: str = "gres:gpu:2", **fields: Any) -> dict[str, Any]:
    return edesc("opportunistic", elastic, tres_per_node=tres, array_inx=array, **fields)


@pytest.mark.parametrize("elastic, array", [
    ("1:2", "0-3"), ("2:2", "0-3"), ("1:2", "0-3%2"), ("1:2", "7"), ("1:2", "0,5,9"),
])
def test_an_array_whose_max_is_a_tasks_gpus_is_a_sweep_of_one_node_jobs(tmp_path: Path, elastic: str,
                                                                         array: str) -> None:
    """MAX == the GPUs per task: each task its own elastic job, as without --array; a throttle is the user's."""
    out = run(tmp_path, adesc(elastic, array))
    jd = accepted(out)
    assert jd["admin_comment"] == f"antman:class=opportunistic;elastic={elastic}"
    assert jd["max_nodes"] == 1 and jd["array_inx"] == array and jd["tres_per_node"] == "gres:antman_opp:2"
    assert f'job "train" of alice: elastic width {elastic.replace(":", " to ")} GPUs' in out["info"][-1]
    assert "across" not in out["info"][-1]


@pytest.mark.parametrize("elastic, array, tasks", [
    ("2:8", "0-3", 4),
    ("8:8", "0-3", 4),           # MIN == MAX: every task needed, still one job across nodes
    ("4:8", "0-7:2", 4),         # 0, 2, 4, 6
    ("2:6", "0,2,4", 3),
    ("2:6", "1-2,5", 3),
    ("2:8", "0-3,2,3", 4),       # an index named twice is one task (Slurm keeps a bitmap)
    ("2:4", "10-11", 2),
    ("2:64", "0-31", 32),        # MAX at the bound
])
def test_an_array_whose_max_is_all_its_tasks_gpus_is_one_job_across_nodes(tmp_path: Path, elastic: str, array: str,
                                                                          tasks: int) -> None:
    out = run(tmp_path, adesc(elastic, array))
    jd = accepted(out)
    # the tag is unchanged: MAX above the task's GPUs tells the rest of the system it spans the array's nodes
    assert jd["admin_comment"] == f"antman:class=opportunistic;elastic={elastic}"
    assert jd["max_nodes"] == 1 and jd["tres_per_node"] == "gres:antman_opp:2" and jd["array_inx"] == array
    lo, hi = elastic.split(":")
    assert out["info"][-1] == (f'slurm-antman: job "train" of alice: elastic width {lo} to {hi} GPUs across the '
                               f"nodes of the {tasks} tasks of --array={array} (2 GPUs each)")


def test_one_gpu_per_task_takes_any_min(tmp_path: Path) -> None:
    out = run(tmp_path, adesc("1:3", "0-2", tres="gres/gpu:1"))
    assert accepted(out)["admin_comment"] == "antman:class=opportunistic;elastic=1:3"
    assert out["info"][-1].endswith("across the nodes of the 3 tasks of --array=0-2 (1 GPU each)")


def test_gpus_per_task_count_per_node_in_an_array(tmp_path: Path) -> None:
    # -n 2 --gpus-per-task=1: two GPUs per task's node, so 2:4 over two tasks is across nodes
    out = run(tmp_path, edesc("opportunistic", "2:4", tres_per_task="gres:gpu:1", num_tasks=2, array_inx="0-1"))
    assert accepted(out)["admin_comment"] == "antman:class=opportunistic;elastic=2:4"
    assert "across the nodes of the 2 tasks" in out["info"][-1]


def test_auto_array_across_nodes_resolved_opportunistic_keeps_the_range(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, edesc("auto", "2:4", tres_per_node="gres:gpu:2", array_inx="0-1"),
                      settings={"auto_class": "opportunistic"}))
    assert jd["admin_comment"] == "antman:class=opportunistic;req=auto;elastic=2:4"


def test_auto_array_across_nodes_resolved_guaranteed_drops_it(tmp_path: Path) -> None:
    out = run(tmp_path, edesc("auto", "2:4", tres_per_node="gres:gpu:2", array_inx="0-1"),
              settings={"auto_class": "guaranteed"})
    assert accepted(out)["admin_comment"] == "antman:class=guaranteed;req=auto"
    assert any("--antman-elastic=2:4 dropped, the job is guaranteed" in line for line in out["info"])


def test_neither_reading_is_refused_naming_both(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, adesc("2:6", "0-3")))
    assert msg == ("slurm-antman: --antman-elastic=2:6 with --array=0-3 (4 tasks) and --gres=gpu:2 per task: MAX "
                   "must be 2 (each task its own elastic job) or 8 (one job across the 4 tasks' nodes, MIN a "
                   "multiple of 2)")
    # MAX below the task's GPUs, and a throttled sweep that does not fit either
    assert "MAX must be 2 (each task its own elastic job) or 8" in rejected(run(tmp_path, adesc("1:1", "0-3")))
    assert "--array=0-3%2 (4 tasks)" in rejected(run(tmp_path, adesc("2:4", "0-3%2")))
    # the step counts: 0-7:2 is four tasks, not eight
    assert "(4 tasks)" in rejected(run(tmp_path, adesc("2:16", "0-7:2")))


def test_min_must_be_whole_nodes(tmp_path: Path) -> None:
    for elastic in ("1:8", "3:8", "5:8"):
        msg = rejected(run(tmp_path, adesc(elastic, "0-3")))
        assert (f"--antman-elastic={elastic} with --array=0-3 (4 tasks) and --gres=gpu:2 per task: one job across "
                "the 4 tasks' nodes changes its width a node (2 GPUs) at a time, so MIN must be a multiple of 2") in msg
    assert "(--antman-elastic=2:8, for one)" in rejected(run(tmp_path, adesc("3:8", "0-3")))
    assert "(--antman-elastic=4:8, for one)" in rejected(run(tmp_path, adesc("5:8", "0-3")))


@pytest.mark.parametrize("array, throttle", [("0-3%2", "%2"), ("0,1,2,3%1", "%1"), ("0-7:2%4", "%4")])
def test_a_users_throttle_is_refused_across_nodes(tmp_path: Path, array: str, throttle: str) -> None:
    msg = rejected(run(tmp_path, adesc("2:8", array)))
    assert f"--antman-elastic=2:8 with --array={array} (4 tasks)" in msg
    assert f"drop the throttle {throttle}; for one job across the tasks' nodes slurm-antman sets the array's task " \
        "throttle itself" in msg


def test_one_task_is_no_array_across_nodes(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, adesc("2:4", "3")))
    assert "--array=3 (1 task) and --gres=gpu:2 per task: MAX must be 2 (each task its own elastic job); one " \
        "job across nodes needs an array of several tasks" in msg


def test_more_gpus_than_the_bound_is_refused(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, adesc("2:64", "0-39")))
    assert "(40 tasks)" in msg and "would need MAX = 40 x 2, over the limit of 64" in msg
    # a large array is counted only as far as it matters
    msg = rejected(run(tmp_path, adesc("2:64", "0-999999")))
    assert "(over 64 tasks)" in msg and "would need MAX = tasks x 2, over the limit of 64" in msg


@pytest.mark.parametrize("fields", [
    {"min_nodes": 2, "max_nodes": 2},                                  # -N 2
    {"req_nodes": "node[1-2]"},                                         # -w node[1-2]
    {"num_tasks": 4, "ntasks_per_node": 2},                             # -n 4 --ntasks-per-node=2
    {"bitflags": 256},                                                  # --spread-job
])
def test_each_task_must_fit_one_node(tmp_path: Path, fields: dict[str, Any]) -> None:
    for elastic in ("2:8", "1:2"):   # across nodes, and a sweep
        msg = rejected(run(tmp_path, adesc(elastic, "0-3", **fields)))
        assert msg.startswith(f"slurm-antman: --antman-elastic={elastic} with --array=0-3: each task of an elastic "
                              "job array runs on one node"), msg


@pytest.mark.parametrize("array", ["0-3x", "3-1", "0-3:0", "a", "0-3%", "0-3%x", "", "0,,1", "-1"])
def test_an_unreadable_array_is_refused(tmp_path: Path, array: str) -> None:
    out = run(tmp_path, adesc("2:8", array))
    if array == "":   # no array at all: MAX must be the node's GPUs
        assert "MAX must equal the GPUs per node" in rejected(out)
        return
    msg = rejected(out)
    assert msg.startswith(f"slurm-antman: --antman-elastic=2:8: cannot read the task count of --array={array} ("), msg


def test_an_array_without_gpus_is_refused(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, edesc("opportunistic", "2:8", array_inx="0-3")))
    assert "--antman-elastic=2:8: the job asks for no GPU" in msg


def test_guaranteed_array_is_refused_as_before(tmp_path: Path) -> None:
    msg = rejected(run(tmp_path, edesc("guaranteed", "2:8", tres_per_node="gres:gpu:2", array_inx="0-3")))
    assert "width is its own" in msg


# ---- docs/user.md shows these messages -----------------------------------------------------------

def test_the_messages_docs_user_md_shows_are_the_scripts(tmp_path: Path) -> None:
    """Each row of docs/user.md's table of refusals from job_submit (the ``slurm-antman: ...`` ones),
    up to its ``...``, is how the script's message for that submission starts."""
    import re

    from test_job_submit_lua import ROOT

    rows = re.findall(r"^\| (.*?) \| `(slurm-antman: [^`]*)` \|$", (ROOT / "docs" / "user.md").read_text(), re.M)
    jobs = {
        "`--antman=guaranteed --antman-elastic=1:2`": edesc("guaranteed", "1:2", tres_per_node="gres:gpu:2"),
        "`--antman-elastic=1:2` without `--antman`": edesc(None, "1:2", tres_per_node="gres:gpu:2"),
        "`--antman-elastic=1:3 --gres=gpu:2`": edesc("opportunistic", "1:3", tres_per_node="gres:gpu:2"),
        "`--antman-elastic=1:2 -N 2 --gres=gpu:2`": edesc("opportunistic", "1:2", tres_per_node="gres:gpu:2",
                                                          min_nodes=2, max_nodes=2),
        "`--antman-elastic=2:6 --array=0-3 --gres=gpu:2`": adesc("2:6", "0-3"),
        "`--antman-elastic=3:8 --array=0-3 --gres=gpu:2`": adesc("3:8", "0-3"),
        "`--antman-elastic=4:8 --array=0-3%2 --gres=gpu:2`": adesc("4:8", "0-3%2"),
    }
    shown = {submitted: message for submitted, message in rows}
    assert set(shown) == set(jobs), sorted(shown)
    for submitted, job in jobs.items():
        msg = rejected(run(tmp_path, job))
        assert msg.startswith(shown[submitted].removesuffix("...").removesuffix("; ")), (submitted, msg)
