"""Checks of the running Slurm and the site files around it: what slurmctld runs with, the SPANK plugin's
and job_submit's files, the Prolog/Epilog, tenant quotas and the controller's clock. Slurm is asked
through the Slurm adapter (slurm_antman.slurm)."""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shlex
import time
from pathlib import Path
from typing import Callable, Optional

from slurm_antman import config as cfgmod
from slurm_antman.admin import site_settings
from slurm_antman.coordinator import tenants
from slurm_antman.slurm import SlurmBackend, SlurmError, SlurmOutputError
from slurm_antman.slurm import version as slurm_version
from .report import Check, fail, ok, warn

SKEW_WARN_S = 2.0
SKEW_FAIL_S = 60.0  # munge credentials carry a timestamp; large skew makes slurmd reject them
COMMAND_TIMEOUT_S = 20.0


def _slurm() -> SlurmBackend:
    from slurm_antman.slurm.cli_backend import CliBackend

    return CliBackend(timeout=COMMAND_TIMEOUT_S)


def _why(e: SlurmError) -> str:
    """The command's own last word (what an admin would see running it), else the adapter's message."""
    lines = [ln.strip() for ln in e.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else e.message


def _read_config() -> dict[str, str]:
    return _slurm().config()


def slurm_config(read: Callable[[], dict[str, str]] = _read_config) -> tuple[Optional[dict[str, str]], Check]:
    """The running Slurm's effective configuration (``scontrol show config``, through the Slurm adapter):
    what slurmctld runs with, whatever files it came from."""
    try:
        conf = read()
    except SlurmError as e:
        return None, fail("slurm", f"scontrol show config failed: {e.message}",
                          "start slurmctld, or set SLURM_CONF to the slurm.conf this host uses")
    return conf, ok("slurm", f"slurmctld answers (Slurm {conf.get('SLURM_VERSION', '?')}, "
                             f"slurm.conf {conf.get('SLURM_CONF', '?')})")


def _plugstack_lines(path: str, depth: int = 0) -> list[tuple[str, str]]:
    """(file, line) of every plugin line in plugstack.conf and the files it includes."""
    if depth > 8:
        return []
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    out = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if words[0] == "include" and len(words) > 1:
            pattern = words[1] if words[1].startswith("/") else str(Path(path).parent / words[1])
            for inc in sorted(glob.glob(pattern)):
                out += _plugstack_lines(inc, depth + 1)
        else:
            out.append((path, line))
    return out


def check_plugstack(cfg: cfgmod.AntmanConfig, sconf: dict[str, str]) -> Check:
    stack = sconf.get("PlugStackConfig") or str(Path(sconf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent
                                                 / "plugstack.conf")
    if not Path(stack).is_file():
        return fail("plugstack", f"PlugStackConfig {stack} does not exist",
                    f"create it with the line: include {Path(stack).parent}/plugstack.conf.d/antman.conf")
    for where, line in _plugstack_lines(stack):
        words = line.split()
        if len(words) >= 2 and words[0] in ("required", "optional") and words[1] == cfg.plugin_path:
            return ok("plugstack", f"{where} loads {cfg.plugin_path} ({words[0]})")
    return fail("plugstack", f"{stack} (with its includes) does not list {cfg.plugin_path}",
                f"`antman config render` writes plugstack.conf.d/antman.conf; add `include "
                f"{Path(stack).parent}/plugstack.conf.d/antman.conf` to {stack}")


def check_sbatch_option() -> Check:
    try:
        text = _slurm().sbatch_help()
    except SlurmError as e:
        return fail("sbatch_option", f"sbatch --help failed: {_why(e)}",
                    "install the Slurm client commands (slurm-client) on this host")
    if "--antman" not in text:
        return fail("sbatch_option", "sbatch --help does not show --antman: the SPANK plugin is not loaded",
                    "check the plugstack line and that the .so loads (slurmctld/slurmd logs name spank errors)")
    return ok("sbatch_option", "sbatch --help shows --antman")


def plugin_slurm_version(path: str) -> tuple[int, int, int]:
    """The Slurm version the plugin was compiled against (SPANK_PLUGIN's ``plugin_version``)."""
    # RTLD_LAZY: the plugin's calls into libslurm stay unresolved, which is fine for reading one integer.
    lib = ctypes.CDLL(os.path.abspath(path), mode=os.RTLD_LAZY | getattr(os, "RTLD_LOCAL", 0))
    v = ctypes.c_uint32.in_dll(lib, "plugin_version").value
    return v >> 16, (v >> 8) & 0xFF, v & 0xFF


def check_versions(cfg: cfgmod.AntmanConfig, sconf: dict[str, str]) -> Check:
    running = sconf.get("SLURM_VERSION", "")
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", running)
    if not m:
        return warn("slurm_version", f"cannot read Slurm's version ({running!r})", "run scontrol show config")
    have = tuple(int(x) for x in m.groups())
    try:
        slurm_version.check_supported(have)
    except slurm_version.UnsupportedSlurm as e:
        return fail("slurm_version", e.message, "run slurm-antman on a supported Slurm")
    try:
        built = plugin_slurm_version(cfg.plugin_path)
    except OSError as e:
        return fail("slurm_version", f"cannot load {cfg.plugin_path}: {e}",
                    "rebuild it on this host: make -C spank install")
    except ValueError:
        return fail("slurm_version", f"{cfg.plugin_path} has no plugin_version: not a SPANK plugin",
                    "plugin_path must name antman_spank.so")
    built_s = f"{built[0]}.{built[1]:02d}.{built[2]}"
    if built[:2] != have[:2]:
        return fail("slurm_version", f"plugin built for Slurm {built_s}, Slurm here is {running}",
                    "rebuild the plugin against this Slurm's headers: make -C spank clean install")
    if not slurm_version.is_tested(have):
        return warn("slurm_version", f"Slurm {running} is supported but untested; slurm-antman is tested on "
                    + " and ".join(slurm_version.fmt(v) for v in slurm_version.TESTED),
                    "run the test suite against this version")
    return ok("slurm_version", f"plugin built for {built_s}, Slurm {running}")


JOB_SUBMIT_MODULE = "antman_job_submit.lua"
JOB_SUBMIT_FILES = ("job_submit.lua", JOB_SUBMIT_MODULE, "antman_settings_loader.lua", "antman_settings.lua")
CHAIN_LINE = ('dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. '
              '"antman_job_submit.lua").chain()')


def check_job_submit(sconf: dict[str, str]) -> Check:
    """The Lua files next to slurm.conf, and the site's job_submit.lua calling the module (whether Slurm
    runs job_submit/lua at all is the slurm_conf check's)."""
    etc = Path(sconf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent
    missing = [n for n in JOB_SUBMIT_FILES if not (etc / n).is_file()]
    if missing:
        return fail("job_submit", f"missing next to slurm.conf in {etc}: {', '.join(missing)}",
                    "copy etc/antman_job_submit.lua and etc/antman_settings_loader.lua there (and etc/job_submit.lua "
                    "where the site has none), and run `antman config render` for antman_settings.lua")
    try:
        text = (etc / "job_submit.lua").read_text(errors="replace")
    except OSError as e:
        return fail("job_submit", f"cannot read {etc / 'job_submit.lua'}: {e.strerror}", "check its permissions")
    code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
    if JOB_SUBMIT_MODULE not in code:
        return fail("job_submit", f"{etc / 'job_submit.lua'} does not load {JOB_SUBMIT_MODULE}: jobs are not "
                                  "classified",
                    f"add this line to it (anywhere at its top level): {CHAIN_LINE}")
    return ok("job_submit", f"job_submit.lua in {etc} loads {JOB_SUBMIT_MODULE}; settings and loader beside it")


def check_slurm_conf(cfg: cfgmod.AntmanConfig, sconf: dict[str, str]) -> list[Check]:
    """The site-wide keys slurm-antman needs, judged on the running Slurm's values (by membership for the
    lists): one line per key that lacks something, naming what the site has and what is needed."""
    probs = site_settings.problems(site_settings.needs(cfg), sconf)
    hint = ("merge the needs into slurm.conf (antman config merge-slurm-conf, or by hand from the rendered "
            "slurm.conf.needed), then restart slurmctld and slurmd")
    if not probs:
        return [ok("slurm_conf", "the site-wide settings slurm-antman needs are in force (GresTypes, preemption, "
                                 "plugins, Prolog/Epilog" + (", AccountingStorageTRES" if sconf.get(
                                     "AccountingStorageType") == tenants.SLURMDBD else "") + ")")]
    return [fail("slurm_conf", p.text, hint) for p in probs]


QUOTA_FILE_NAME = "antman_quota.lua"  # the one name job_submit.lua reads, from its own directory


def check_quota_file(cfg: cfgmod.AntmanConfig, sconf: Optional[dict[str, str]]) -> Check:
    """Without coordinator.quota_file the coordinator writes no quota use, and job_submit.lua resolves
    every ``--antman=auto`` job to auto_class (guaranteed by default) whatever the tenant holds."""
    path = cfg.coordinator.quota_file
    example = "/etc/slurm/" + QUOTA_FILE_NAME
    if sconf is not None:
        example = str(Path(sconf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent / QUOTA_FILE_NAME)
    if not path:
        if cfg.tenants or cfg.coordinator.quota_source == "accounting":
            why = (f"{len(cfg.tenants)} tenant(s) in antman.yaml" if cfg.tenants
                   else "coordinator.quota_source is accounting")
            return fail("quota_file", f"{why} but coordinator.quota_file is unset: --antman=auto ignores "
                                      "tenant quotas and every auto job gets auto_class",
                        f"add `quota_file: {example}` under coordinator: in antman.yaml (next to job_submit.lua, "
                        "writable by the coordinator) and systemctl reload antman-coordinator")
        if cfg.coordinator.quota_source == "auto" and (sconf or {}).get("AccountingStorageType") == tenants.SLURMDBD:
            return warn("quota_file", "coordinator.quota_file is unset: if accounts have GrpTRES GPU limits in "
                                      "Slurm accounting, --antman=auto ignores them",
                        f"add `quota_file: {example}` under coordinator: in antman.yaml")
        return ok("quota_file", "no tenants in antman.yaml and coordinator.quota_file unset: auto jobs get "
                                "the site's auto_class")
    if Path(path).name != QUOTA_FILE_NAME:
        return fail("quota_file", f"coordinator.quota_file is {path}; job_submit.lua reads only {QUOTA_FILE_NAME}",
                    f"set coordinator.quota_file: {Path(path).parent / QUOTA_FILE_NAME} (in the directory "
                    "of job_submit.lua)")
    if sconf is not None and os.path.realpath(Path(path).parent) != os.path.realpath(Path(example).parent):
        # A warning: on a node in configless mode slurm.conf lives elsewhere than on the controller.
        return warn("quota_file", f"coordinator.quota_file {path} is not next to slurm.conf "
                                  f"({Path(example).parent}), where slurmctld loads job_submit.lua from",
                    f"on the controller set coordinator.quota_file: {example}")
    return ok("quota_file", f"the coordinator writes tenant quota use to {path}")


def check_hooks(sconf: dict[str, str]) -> Check:
    """The programs Slurm runs as Prolog/Epilog are executable here (whether one of them runs antman's
    hook is the slurm_conf check's)."""
    problems = []
    for key in ("Prolog", "Epilog"):
        progs = site_settings._members(sconf.get(key))
        if not progs:
            problems.append(f"{key} is not set")
            continue
        base = Path(sconf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent
        for prog in progs:
            path = shlex.split(prog)[0] if prog.strip() else prog
            path = path if path.startswith("/") else str(base / path)
            found = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
            for f in found or [path]:
                if not os.access(f, os.X_OK):
                    problems.append(f"{key}={f} is not an executable file")
    if problems:
        return fail("prolog_epilog", "; ".join(problems),
                    "set Prolog=/Epilog= to the rendered antman-prolog/antman-epilog (slurm.conf.needed); the "
                    "hooks must be executable on every node")
    return ok("prolog_epilog", f"Prolog={sconf['Prolog']}, Epilog={sconf['Epilog']}")


def _read_associations(cluster: str) -> list:
    from slurm_antman.slurm.cli_backend import CliBackend

    return CliBackend(timeout=COMMAND_TIMEOUT_S).associations(cluster)


def check_quotas(cfg: cfgmod.AntmanConfig, sconf: dict[str, str],
                 read: Callable[[str], list] = _read_associations) -> Check:
    """Which source the coordinator takes tenant quotas from, and where antman.yaml and accounting
    disagree (the coordinator follows the source in force; a disagreement is an admin's to settle)."""
    source = cfg.coordinator.quota_source
    storage = sconf.get("AccountingStorageType", "")
    yaml_q = tenants.quotas_from_config(cfg)
    yaml_text = f"antman.yaml tenants ({len(yaml_q)})"
    if storage != tenants.SLURMDBD:
        if source == "accounting":
            return fail("quotas", f"quota_source is accounting but Slurm runs with AccountingStorageType="
                                  f"{storage or '(unset)'}", f"set AccountingStorageType={tenants.SLURMDBD} in slurm.conf "
                                  "(with slurmdbd), or coordinator.quota_source: auto")
        return ok("quotas", f"{yaml_text}: Slurm has no accounting storage ({storage or 'unset'})")
    tres = f"gres/{cfg.slurm.gpu_gres}"
    tracked = [t.strip() for t in sconf.get("AccountingStorageTRES", "").split(",")]
    if source != "antman_yaml" and tres not in tracked:
        return warn("quotas", f"Slurm accounting does not track {tres} (AccountingStorageTRES="
                              f"{sconf.get('AccountingStorageTRES', '') or '(unset)'}): no account can have a GPU quota "
                              "there, so every tenant is unlimited", f"add {tres} to AccountingStorageTRES in slurm.conf "
                              "and restart slurmctld; then sacctmgr ... set GrpTRES=" + tres + "=N")
    try:
        reading = tenants.quotas_from_associations(read(cfg.cluster_name), cfg.cluster_name, cfg.slurm.gpu_gres)
    except SlurmError as e:
        in_force = yaml_text if source == "antman_yaml" else "the last quotas the coordinator read from accounting"
        return warn("quotas", f"{in_force}; cannot read accounting: {e}",
                    "start slurmdbd (and its database); sacctmgr show associations must answer")
    in_force = (f"{yaml_text} (quota_source: antman_yaml overrides accounting)" if source == "antman_yaml" else
                "Slurm accounting (GrpTRES=gres/%s on %d account(s)%s)" % (
                    cfg.slurm.gpu_gres, len(reading.quotas),
                    ": " + ", ".join(f"{a}={n}" for a, n in sorted(reading.quotas.items())) if reading.quotas else ""))
    issues = [*reading.problems, *(tenants.disagreements(yaml_q, reading, cfg.cluster_name, cfg.slurm.gpu_gres)
                                   if yaml_q or source == "antman_yaml" else [])]
    if issues:
        more = f" (+{len(issues) - 1} more, in the hint)" if len(issues) > 1 else ""
        return Check("quotas", "warn", f"{in_force}; {issues[0]}{more}",
                     "make antman.yaml tenants and sacctmgr agree (or drop the tenants from antman.yaml); all: "
                     + " | ".join(issues))
    return ok("quotas", in_force)


def controller_time() -> tuple[Optional[float], str]:
    """slurmctld's own clock (``sdiag``), or why it cannot be read."""
    try:
        return _slurm().controller_time(), ""
    except SlurmOutputError as e:
        return None, e.message
    except SlurmError as e:
        return None, _why(e)


def check_clock(get_time: Callable[[], tuple[Optional[float], str]] = controller_time) -> Check:
    before = time.time()
    theirs, err = get_time()
    after = time.time()
    if theirs is None:
        return warn("clock_skew", f"cannot read slurmctld's time: {err}", "check that sdiag works here")
    # sdiag gives whole seconds: a skew under the round trip plus one second is no skew.
    mid = (before + after) / 2
    skew = theirs - mid
    slack = (after - before) / 2 + 1.0
    size = max(0.0, abs(skew) - slack)
    if size > SKEW_FAIL_S:
        return fail("clock_skew", f"this host's clock is {skew:+.0f} s off slurmctld's",
                    "run chrony/ntpd on every host; munge rejects credentials from skewed clocks")
    if size > SKEW_WARN_S:
        return warn("clock_skew", f"this host's clock is {skew:+.0f} s off slurmctld's", "run chrony/ntpd")
    return ok("clock_skew", f"within {slack:.1f} s of slurmctld")
