"""etc/cli_filter.lua (the one line calling etc/antman_cli_filter.lua) and etc/examples/cli_filter.lua (a
site's own filter calling it) run under lua5.1, with tests/lua/cli_harness.lua standing in for srun's
cli_filter/lua."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest

from test_job_submit_lua import SETTINGS, lua_literal

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "etc" / "cli_filter.lua"
SITE_SCRIPT = ROOT / "etc" / "examples" / "cli_filter.lua"
HARNESS = ROOT / "tests" / "lua" / "cli_harness.lua"
LUA = shutil.which("lua5.1")
LINE = 'dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "antman_cli_filter.lua").chain()\n'

pytestmark = pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed (apt-get install lua5.1)")

IN_JOB = {"SLURM_JOB_ID": "77", "ANTMAN_CLASS": "opportunistic"}


def run(tmp_path: Path, options: dict[str, Any], *, env: Optional[dict[str, str]] = None, spank: Optional[str] = None,
        script: Path | str = SCRIPT, settings: Optional[dict[str, Any]] = None,
        modules: tuple[str, ...] = ("antman_cli_filter.lua", "antman_settings_loader.lua")) -> dict[str, Any]:
    d = tmp_path / "etc"
    d.mkdir(exist_ok=True)
    if isinstance(script, Path):
        shutil.copy(script, d / "cli_filter.lua")
    else:
        (d / "cli_filter.lua").write_text(script)
    for name in modules:
        shutil.copy(ROOT / "etc" / name, d / name)
    if settings != {}:
        merged = {**SETTINGS, "gpu_types": {"h100": 4, "a100": 4}, **(settings or {})}
        (d / "antman_settings.lua").write_text("return " + lua_literal(merged) + "\n")
    case = tmp_path / "case.lua"
    case.write_text("return " + lua_literal({"options": {"type": "srun", **options}, "env": env or {},
                                             "spank": spank}) + "\n")
    r = subprocess.run([LUA, str(HARNESS), str(d / "cli_filter.lua"), str(case)], capture_output=True, text=True,
                       timeout=20)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "load_error" not in out and "call_error" not in out and "missing" not in out, out
    return out


def test_the_plain_filter_is_the_one_line_a_site_adds() -> None:
    assert [l for l in SCRIPT.read_text().splitlines() if l and not l.startswith("--")] == [LINE.strip()]
    assert LINE in SITE_SCRIPT.read_text()


@pytest.mark.parametrize("options, gres", [
    ({"gres": "gpu:1"}, "antman_opp:1"),
    ({"gres": "gres:gpu:2,gres:nic:1"}, "nic:1,antman_opp:2"),
    ({"gpus": "2"}, "antman_opp:2"),
    ({"gres": "gpu:h100:1"}, "antman_opp:1"),  # a step: the job's slots are on its node already
    ({"gpus-per-task": "a100:1", "ntasks": "2"}, "antman_opp:2"),
])
def test_a_step_in_an_opportunistic_job_asks_for_its_slots(tmp_path: Path, options: dict, gres: str) -> None:
    out = run(tmp_path, options, env=IN_JOB)
    assert out["rc"] == 0 and out["options"]["gres"] == gres, out
    assert "gpus" not in out["options"] and "gpus-per-task" not in out["options"]


@pytest.mark.parametrize("options, gres", [
    ({"gres": "gpu:h100:2"}, "antman_opp:h100:2"),
    ({"gpus-per-node": "a100:3"}, "antman_opp:a100:3"),
    ({"gres": "gpu:2"}, "antman_opp:2"),
])
def test_a_new_opportunistic_job_keeps_its_gpu_type(tmp_path: Path, options: dict, gres: str) -> None:
    """srun --antman=opportunistic outside an allocation makes the job: job_submit.lua places it by type."""
    out = run(tmp_path, options, spank="opportunistic")
    assert out["rc"] == 0 and out["options"]["gres"] == gres, out


def test_a_new_job_with_two_gpu_types_is_refused(tmp_path: Path) -> None:
    out = run(tmp_path, {"gres": "gpu:h100:1", "gpus-per-node": "a100:1"}, spank="opportunistic")
    assert out["rc"] == -1
    assert out["error"] == ["slurm-antman: an opportunistic job asks for GPUs of one type; this srun asks for "
                            "h100 and a100"]


def test_guaranteed_and_sbatch_are_left_alone(tmp_path: Path) -> None:
    out = run(tmp_path, {"gres": "gpu:1"}, env={"SLURM_JOB_ID": "5", "ANTMAN_CLASS": "guaranteed"})
    assert out["options"]["gres"] == "gpu:1"
    out = run(tmp_path, {"type": "sbatch", "gres": "gpu:1"}, spank="opportunistic")
    assert out["options"]["gres"] == "gpu:1"


def test_without_settings_the_command_runs_unchanged(tmp_path: Path) -> None:
    out = run(tmp_path, {"gres": "gpu:1"}, env=IN_JOB, settings={})
    assert out["rc"] == 0 and out["options"]["gres"] == "gpu:1"


def test_without_the_loader_every_command_runs_unchanged(tmp_path: Path) -> None:
    """On a login node a missing antman_settings_loader.lua must not stop srun: the three hooks still
    exist (Slurm needs them), the site's own rules still run, and antman's rewrite does nothing."""
    out = run(tmp_path, {"gres": "gpu:1"}, env=IN_JOB, modules=("antman_cli_filter.lua",))
    assert out["rc"] == 0 and out["options"]["gres"] == "gpu:1"
    out = run(tmp_path, {"gres": "gpu:1", "overcommit": "set"}, env=IN_JOB, script=SITE_SCRIPT,
              modules=("antman_cli_filter.lua",))
    assert out["rc"] == -1 and out["options"]["gres"] == "gpu:1"


def test_site_example_rule_then_antman(tmp_path: Path) -> None:
    out = run(tmp_path, {"gres": "gpu:1", "overcommit": "set"}, env=IN_JOB, script=SITE_SCRIPT)
    assert out["rc"] == -1 and out["error"] == ["site policy: --overcommit (-O) is not allowed on this cluster"]
    assert out["options"]["gres"] == "gpu:1"  # refused by the site: antman's rewrite never ran
    out = run(tmp_path, {"gres": "gpu:1"}, env=IN_JOB, script=SITE_SCRIPT)
    assert out["rc"] == 0 and out["options"]["gres"] == "antman_opp:1"


def test_site_functions_defined_after_the_line_are_chained(tmp_path: Path) -> None:
    script = LINE + (
        "function slurm_cli_setup_defaults() return slurm.SUCCESS end\n"
        "function slurm_cli_pre_submit(options, offset) options.comment = 'site' return slurm.SUCCESS end\n"
        "function slurm_cli_post_submit() return slurm.SUCCESS end\n")
    out = run(tmp_path, {"gres": "gpu:2"}, env=IN_JOB, script=script + LINE)  # a second line changes nothing
    assert out["rc"] == 0 and out["options"]["comment"] == "site" and out["options"]["gres"] == "antman_opp:2"
