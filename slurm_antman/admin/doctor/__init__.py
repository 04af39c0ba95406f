"""``antman doctor``: checks one node or the controller host and names what is missing or wrong.

Each check gives ok, warn or fail, a one-line reason, and for anything not ok a hint saying what to
do. Checks that depend on an earlier one (Slurm reachable, config valid) are skipped with a reason
rather than failing twice for one cause. Exit status: 1 when any check failed, else 0.
The checks live by what they look at: ``controller`` (Slurm and the site's files), ``node`` (this GPU
node's own pieces); ``report`` is how a check reads.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from slurm_antman import config as cfgmod
from .controller import (
    CHAIN_LINE, COMMAND_TIMEOUT_S, JOB_SUBMIT_FILES, JOB_SUBMIT_MODULE, QUOTA_FILE_NAME, SKEW_FAIL_S,
    SKEW_WARN_S, check_clock, check_hooks, check_job_submit, check_plugstack, check_quota_file, check_quotas,
    check_sbatch_option, check_slurm_conf, check_versions, controller_time, plugin_slurm_version,
    slurm_config,
)
from .node import (
    check_agent_bundle, check_coordinator, check_device_control, check_enforcement, check_nvml, check_pin_budget,
    check_plugin_file, check_sidecar,
    check_socket_dir, driver_memory_caps,
)
from .report import Check, fail, ok, render_text, skip, warn

__all__ = [
    "CHAIN_LINE", "COMMAND_TIMEOUT_S", "JOB_SUBMIT_FILES", "JOB_SUBMIT_MODULE", "QUOTA_FILE_NAME", "SKEW_FAIL_S",
    "SKEW_WARN_S", "Check", "check_agent_bundle", "check_clock", "check_config", "check_coordinator",
    "check_device_control", "check_enforcement", "check_hooks", "check_job_submit", "check_nvml", "check_plugin_file", "check_plugstack",
    "check_quota_file", "check_quotas", "check_sbatch_option", "check_sidecar", "check_slurm_conf",
    "check_socket_dir", "check_versions", "controller_time", "driver_memory_caps", "fail", "main", "ok",
    "plugin_slurm_version", "render_text", "run_checks", "skip", "slurm_config", "warn",
]


def check_config(path: str) -> tuple[Optional[cfgmod.AntmanConfig], Check]:
    try:
        cfg = cfgmod.load(path)
    except cfgmod.ConfigError as e:
        line = f"line {e.lines[0]}: " if e.lines and e.lines[0] is not None else ""
        first = f"{line}{e.problems[0][0]}: {e.problems[0][1]}" if e.problems else str(e)
        more = f" (+{len(e.problems) - 1} more)" if len(e.problems) > 1 else ""
        return None, fail("config", f"{path}: {first}{more}",
                          f"fix the file; `antman config check {path}` lists every problem")
    return cfg, ok("config", f"{path} is valid ({sum(len(g.hosts) for g in cfg.nodes)} nodes, "
                             f"{len(cfg.tenants)} tenants)")


def run_checks(config_path: str, node: str) -> list[Check]:
    checks: list[Check] = []
    cfg, c = check_config(config_path)
    checks.append(c)
    sconf, c = slurm_config()
    checks.append(c)
    need_cfg = "antman.yaml is not valid"
    need_slurm = "Slurm does not answer"
    checks.append(check_plugin_file(cfg) if cfg else skip("spank_plugin", need_cfg))
    if cfg and sconf:
        checks.append(check_plugstack(cfg, sconf))
    else:
        checks.append(skip("plugstack", need_cfg if not cfg else need_slurm))
    checks.append(check_sbatch_option())
    if cfg and sconf and Path(cfg.plugin_path).is_file():
        checks.append(check_versions(cfg, sconf))
    else:
        checks.append(skip("slurm_version", need_slurm if not sconf else "no plugin file to read"))
    if cfg and sconf:
        checks += check_slurm_conf(cfg, sconf)
    else:
        checks.append(skip("slurm_conf", need_cfg if not cfg else need_slurm))
    checks.append(check_job_submit(sconf) if sconf else skip("job_submit", need_slurm))
    checks.append(check_quota_file(cfg, sconf) if cfg else skip("quota_file", need_cfg))
    checks.append(check_hooks(sconf) if sconf else skip("prolog_epilog", need_slurm))
    checks.append(check_agent_bundle(cfg, node) if cfg else skip("agent_bundle", need_cfg))
    checks.append(check_sidecar(cfg, node) if cfg else skip("sidecar", need_cfg))
    checks.append(check_coordinator(cfg, node) if cfg else skip("coordinator_link", need_cfg))
    checks.append(check_nvml())
    checks.append(check_pin_budget(cfg, node) if cfg else skip("pin_budget", need_cfg))
    checks.append(check_enforcement(cfg, sconf) if cfg else skip("enforcement", need_cfg))
    checks.append(check_device_control(cfg, node) if cfg else skip("device_control", need_cfg))
    checks.append(check_quotas(cfg, sconf) if cfg and sconf else skip("quotas", need_cfg if not cfg else need_slurm))
    checks.append(check_clock() if sconf else skip("clock_skew", need_slurm))
    checks.append(check_socket_dir(cfg) if cfg else skip("socket_dir", need_cfg))
    return checks


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="antman doctor", description="check a slurm-antman node or controller")
    ap.add_argument("--config", default=None,
                    help="antman.yaml (default: $ANTMAN_CONFIG or /etc/slurm-antman/antman.yaml)")
    ap.add_argument("--node", default=None, help="Slurm node name of this host (default: short hostname)")
    ap.add_argument("--json", action="store_true", help="one JSON object per check, in a list")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    path = a.config or os.environ.get("ANTMAN_CONFIG", "/etc/slurm-antman/antman.yaml")
    node = a.node or socket.gethostname().split(".")[0]
    checks = run_checks(path, node)
    if a.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        sys.stdout.write(render_text(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0

