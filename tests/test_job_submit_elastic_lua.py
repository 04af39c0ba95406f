"""job_submit.lua and --antman-elastic=MIN:MAX (issue 29 part 3, docs/elastic.md), under lua5.1 with
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
def test_across_nodes_is_refused(tmp_path: Path, fields: dict[str, Any]) -> None:
    msg = rejected(run(tmp_path, edesc("opportunistic", "1:2", **fields)))
    assert "--antman-elastic=1:2: an elastic job runs on one node" in msg and "not built yet" in msg


def test_one_named_node_is_fine(tmp_path: Path) -> None:
    jd = accepted(run(tmp_path, edesc("opportunistic", "1:2", req_nodes="node2", tres_per_node="gres:gpu:2")))
    assert jd["admin_comment"] == "antman:class=opportunistic;elastic=1:2" and jd["max_nodes"] == 1


def test_unset_numbers_are_unset(tmp_path: Path) -> None:
    # NO_VAL in min/max nodes is "not given", not "4294967294 nodes"
    jd = accepted(run(tmp_path, edesc("opportunistic", "1:2", min_nodes=NO_VAL, max_nodes=NO_VAL,
                                      tres_per_node="gres:gpu:2")))
    assert jd["max_nodes"] == 1


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
    }
    shown = {submitted: message for submitted, message in rows}
    assert set(shown) == set(jobs), sorted(shown)
    for submitted, job in jobs.items():
        msg = rejected(run(tmp_path, job))
        assert msg.startswith(shown[submitted].removesuffix("...").removesuffix("; ")), (submitted, msg)
