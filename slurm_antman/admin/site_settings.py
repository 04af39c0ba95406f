"""The site-wide slurm.conf settings slurm-antman needs: listed, merged and checked, never imposed.

The rendered ``antman.slurm.conf`` holds only what slurm-antman owns (its GPU nodes and its two
partitions). Keys such as ``SlurmctldParameters`` belong to the site: a value in an Include'd fragment
would replace the site's own (Slurm keeps the last one it reads), dropping e.g. ``enable_configless``.
So each need says what slurm-antman requires of a key (members of a list, one value, a mode that is not
OFF, a hook that runs), and

- ``antman config render`` lists them in ``slurm.conf.needed``, with the reason for each;
- ``antman config merge-slurm-conf`` merges them into a site's slurm.conf (:func:`merge_file`): members
  appended to the site's lists, unset keys added, the original backed up, every change printed, and
  nothing written when a key holds a value slurm-antman cannot share (a conflict);
- ``antman doctor`` judges the running Slurm's effective configuration (``scontrol show config``,
  :func:`problems`) and prints one line per conflict.

A list key is judged by membership (``SlurmctldParameters=enable_configless,preempt_send_user_signal``
is fine), never by equality.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from slurm_antman.config import AntmanConfig
from slurm_antman.errors import AntmanError

LIST, SCALAR, PREEMPT_MODE, HOOK = "list", "scalar", "preempt_mode", "hook"
SLURMDBD = "accounting_storage/slurmdbd"
UNSET = ("", "(null)", "none", "n/a")


@dataclass(frozen=True)
class Need:
    key: str  # as slurm.conf(5) spells it
    kind: str  # LIST: members; SCALAR: one value; PREEMPT_MODE: not OFF; HOOK: a program that runs antman's hook
    values: tuple[str, ...]  # LIST: the members; SCALAR: the value; HOOK: the hook's path, () when unknown
    why: str
    accounting_only: bool = False  # judged only where AccountingStorageType is slurmdbd

    def line(self) -> str:
        """The slurm.conf line for a site that does not set the key yet."""
        if self.kind == PREEMPT_MODE:
            return f"{self.key}=REQUEUE"
        return f"{self.key}={','.join(self.values) or '/PATH/TO/antman-' + self.key.lower()}"


def needs(cfg: AntmanConfig, hook_dir: Optional[str] = None, with_antman: bool = True) -> list[Need]:
    """What slurm-antman needs of the site's slurm.conf. ``hook_dir``: where ``antman config render`` put
    antman-prolog/epilog (None: judged by what the site's Prolog runs); ``with_antman`` False: the same
    cluster without the slurm-antman stack (the benchmarks' baselines), which still has both GRES and the
    partitions' preemption."""
    s = cfg.slurm
    out = [
        Need("GresTypes", LIST, (s.gpu_gres, s.opportunistic_gres),
             "the physical GPUs, and the count-only slots opportunistic jobs ask for"),
        Need("PreemptType", SCALAR, ("preempt/partition_prio",),
             "the partitions' PriorityTier lets a guaranteed job take resources back from opportunistic ones"),
        Need("PreemptMode", PREEMPT_MODE, ("REQUEUE",),
             "Slurm refuses a PreemptType without a cluster-wide PreemptMode other than OFF; the opportunistic "
             "partition sets its own (REQUEUE), so any other mode of the site's stays"),
        Need("AccountingStorageTRES", LIST, (f"gres/{s.gpu_gres}", f"gres/{s.opportunistic_gres}"),
             "sacct and sreport count GPUs of both classes (opportunistic jobs hold only the slots), and "
             f"tenant quotas are GrpTRES=gres/{s.gpu_gres}=N", accounting_only=True),
    ]
    if with_antman:
        prolog = (f"{hook_dir.rstrip('/')}/antman-prolog",) if hook_dir else ()
        epilog = (f"{hook_dir.rstrip('/')}/antman-epilog",) if hook_dir else ()
        out += [
            Need("SlurmctldParameters", LIST, ("preempt_send_user_signal",),
                 "the job's own --signal reaches it on preemption (how Lightning and submitit checkpoint)"),
            Need("JobSubmitPlugins", LIST, ("lua",), "runs job_submit.lua, which classifies jobs"),
            Need("CliFilterPlugins", LIST, ("cli_filter/lua",),
                 "runs cli_filter.lua in srun: a step's GPU options in an opportunistic job name its slots"),
            Need("PrologFlags", LIST, ("Alloc",),
                 "the Prolog runs when the allocation is made, so the GPU is chosen before the first task"),
            Need("Prolog", HOOK, prolog, "registers the job at its node's sidecar, which picks its GPU"),
            Need("Epilog", HOOK, epilog, "retires the job at its node's sidecar"),
        ]
    return out


def needed_text(cfg: AntmanConfig, hook_dir: Optional[str], header: str, with_antman: bool = True) -> str:
    """The rendered ``slurm.conf.needed``: the lines a site without these keys would add, each with its
    rule and reason; the merge command for a site that has its own values."""
    out = [header.rstrip("\n"),
           "# The site-wide slurm.conf settings slurm-antman needs. NOT for Include: Slurm keeps the last value",
           "# it reads, so a line here would replace your own. Merge them into slurm.conf, keeping your values:",
           "#   antman config merge-slurm-conf ANTMAN_YAML --slurm-conf /etc/slurm/slurm.conf --hook-dir DIR",
           "# and check the running Slurm with `antman doctor` (its slurm_conf lines).", ""]
    for n in needs(cfg, hook_dir, with_antman):
        if n.kind == LIST:
            rule = f"must list {' and '.join(n.values)}"
        elif n.kind == SCALAR:
            rule = f"must be {n.values[0]}"
        elif n.kind == PREEMPT_MODE:
            rule = "must not be OFF (REQUEUE where unset)"
        else:
            rule = "must run antman's hook (one of several programs from Slurm 24.11, or called by yours)"
        when = " (with AccountingStorageType=accounting_storage/slurmdbd)" if n.accounting_only else ""
        out.append(f"# {n.key} {rule}{when}: {n.why}")
        out.append(n.line())
    return "\n".join(out) + "\n"


# --- judging values ------------------------------------------------------------------------------

def _members(value: Optional[str]) -> list[str]:
    if value is None or value.strip().lower() in UNSET:
        return []
    return [m.strip() for m in value.split(",") if m.strip() and m.strip().lower() not in UNSET]


def _norm(key: str, member: str) -> str:
    m = member.strip().lower()
    k = key.lower()
    if k == "slurmctldparameters":
        return m.split("=", 1)[0]  # max_dbd_msg_action=discard: the flag, without its value
    if k == "jobsubmitplugins":
        return m.removeprefix("job_submit/")
    if k == "clifilterplugins":
        return m.removeprefix("cli_filter/")
    return m


# PrologFlags that make Slurm set Alloc too (slurm.conf(5): Contain and X11 imply Alloc; RunInJob Contain).
_IMPLIES_ALLOC = {"contain", "x11", "runinjob"}


def missing_members(need: Need, value: Optional[str]) -> list[str]:
    have = {_norm(need.key, m) for m in _members(value)}
    if need.key.lower() == "prologflags" and have & _IMPLIES_ALLOC:
        have.add("alloc")
    return [v for v in need.values if _norm(need.key, v) not in have]


def _unset_scalar(value: Optional[str]) -> bool:
    return value is None or value.strip().lower() in UNSET or value.strip().lower() == "preempt/none"


def preempt_base_mode(value: Optional[str]) -> str:
    """The mode in ``PreemptMode`` without the GANG/WITHIN flags, upper case; OFF when unset."""
    modes = [m.upper() for m in _members(value) if m.upper() not in ("GANG", "WITHIN")]
    return modes[0] if modes else "OFF"


_HOOK_TEXT = {"Prolog": re.compile(r"antman-prolog|\bnode\s+prolog\b"),
              "Epilog": re.compile(r"antman-epilog|\bnode\s+epilog\b")}


def _read_head(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode(errors="replace")
    except OSError:
        return None


def hook_runs(need: Need, programs: Sequence[str], read: Callable[[str], Optional[str]] = _read_head,
              base_dir: Optional[Path] = None) -> tuple[bool, list[str]]:
    """Whether one of ``programs`` (slurm.conf's Prolog= values; globs allowed from 24.11) is antman's hook
    or a program that calls it: (True, []) or (False, programs that could not be read here)."""
    unreadable = []
    for prog in programs:
        path = prog if prog.startswith("/") or base_dir is None else str(base_dir / prog)
        paths = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
        for p in paths:
            if need.values and os.path.normpath(p) == os.path.normpath(need.values[0]):
                return True, []
            text = read(p)
            if text is None:
                unreadable.append(p)
            elif _HOOK_TEXT[need.key].search(text):
                return True, []
    return False, unreadable


@dataclass(frozen=True)
class Problem:
    key: str
    have: str  # the site's value as Slurm reports it, "" when unset
    text: str  # one line: the key, what the site has, what slurm-antman needs, what to do


def judge(need: Need, value: Optional[str], programs: Optional[Sequence[str]] = None,
          read: Callable[[str], Optional[str]] = _read_head, base_dir: Optional[Path] = None) -> Optional[Problem]:
    """What is wrong with one key's value for slurm-antman, or None. ``programs`` (HOOK): the key's values
    when Slurm runs several (24.11's Prolog[0], Prolog[1], ...), default: ``value`` split on commas."""
    have = "" if value is None or value.strip().lower() in UNSET else value.strip()
    shown = f"{need.key}={have}" if have else f"{need.key} is not set"
    if need.kind == LIST:
        missing = missing_members(need, have)
        if not missing:
            return None
        what = " and ".join(missing)
        if not have:
            return Problem(need.key, have, f"{shown}: set {need.key}={','.join(missing)}")
        return Problem(need.key, have, f"{shown} lacks {what}: add {'it' if len(missing) == 1 else 'them'} "
                                       "to the list")
    if need.kind == SCALAR:
        if have.lower() == need.values[0].lower():
            return None
        if _unset_scalar(have):
            return Problem(need.key, have, f"{shown}: set {need.key}={need.values[0]}")
        return Problem(need.key, have, f"{shown}, slurm-antman needs {need.values[0]} ({need.why})")
    if need.kind == PREEMPT_MODE:
        if preempt_base_mode(have) != "OFF":
            return None
        return Problem(need.key, have, f"{shown}{' (no mode but OFF)' if have else ''}: set a mode other than "
                                       f"OFF, e.g. {need.key}={','.join([*_members(have), 'REQUEUE'])} ({need.why})")
    # HOOK
    progs = list(programs) if programs is not None else _members(have)
    hook = need.values[0] if need.values else f"antman-{need.key.lower()} (from `antman config render`)"
    if not progs:
        return Problem(need.key, have, f"{shown}: set {need.key}={hook}")
    runs, unreadable = hook_runs(need, progs, read, base_dir)
    if runs:
        return None
    if unreadable:
        return Problem(need.key, have, f"{shown}: cannot read {', '.join(unreadable)} here to see whether it runs "
                                       f"{hook}; run antman doctor on a node")
    return Problem(need.key, have, f"{shown} does not run {hook}: call it from your {need.key} (keeping its exit "
                                   f"status), or add it as another {need.key}= line on Slurm 24.11")


def problems(ns: Iterable[Need], conf: Mapping[str, str], read: Callable[[str], Optional[str]] = _read_head
             ) -> list[Problem]:
    """Every need the running Slurm's effective configuration (``scontrol show config``) does not meet."""
    base = Path(conf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent
    slurmdbd = conf.get("AccountingStorageType", "") == SLURMDBD
    out = []
    for n in ns:
        if n.accounting_only and not slurmdbd:
            continue
        p = judge(n, conf.get(n.key), read=read, base_dir=base)
        if p is not None:
            out.append(p)
    return out


# --- merging into a site's slurm.conf ----------------------------------------------------------------

class MergeError(AntmanError):
    """slurm.conf cannot be read or written."""


# Lines that describe one node, partition, ... : their keys (PreemptMode= on a PartitionName line) are
# that entity's, not the cluster's.
_ENTITY_KEYS = {"nodename", "partitionname", "nodeset", "downnodes", "frontendname", "switchname"}
_TOKEN = re.compile(r'(?P<key>[A-Za-z][A-Za-z0-9_]*)[ \t]*=[ \t]*(?P<value>"[^"]*"|[^\s#]*)')


@dataclass
class _Assignment:
    doc: int  # index into the documents
    line: int
    key: str  # as the site spells it
    start: int  # span of the value in the line
    end: int
    value: str  # without quotes
    quoted: bool


@dataclass
class _Doc:
    path: Optional[Path]
    lines: list[str]
    changed: bool = False


def _strip_comment(line: str) -> str:
    out, i = [], 0
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line) and line[i + 1] == "#":
            out.append("  ")
            i += 2
            continue
        if c == "#":
            break
        out.append(c)
        i += 1
    return "".join(out)


def _assignments(docs: list[_Doc]) -> list[_Assignment]:
    found = []
    for di, doc in enumerate(docs):
        for li, line in enumerate(doc.lines):
            body = _strip_comment(line)
            tokens = list(_TOKEN.finditer(body))
            if not tokens or body[:tokens[0].start()].strip():
                continue  # Include lines and anything that is not KEY=VALUE
            if tokens[0].group("key").lower() in _ENTITY_KEYS:
                continue
            for t in tokens:
                raw = t.group("value")
                quoted = raw.startswith('"') and raw.endswith('"') and len(raw) >= 2
                found.append(_Assignment(di, li, t.group("key"), t.start("value"), t.end("value"),
                                         raw[1:-1] if quoted else raw, quoted))
    return found


def _read_docs(path: Path, depth: int = 0, seen: Optional[set] = None) -> list[_Doc]:
    """slurm.conf and, in Slurm's reading order, the files its Include lines name."""
    seen = seen if seen is not None else set()
    real = os.path.realpath(path)
    if depth > 8 or real in seen:
        return []
    seen.add(real)
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        if depth == 0:
            raise MergeError(f"cannot read {path}: {e.strerror or e}") from None
        return []  # an Include that does not exist here: Slurm would stop; judged by antman doctor
    docs = [_Doc(Path(path), lines)]
    for line in lines:
        words = _strip_comment(line).split()
        if len(words) >= 2 and words[0].lower() == "include":
            target = words[1] if words[1].startswith("/") else str(Path(path).parent / words[1])
            for inc in sorted(glob.glob(target)) if any(c in target for c in "*?[") else [target]:
                docs += _read_docs(Path(inc), depth + 1, seen)
    return docs


@dataclass
class MergeResult:
    changes: list[str] = field(default_factory=list)  # one line per change, what was and what is
    conflicts: list[str] = field(default_factory=list)  # one line per key the merge cannot settle
    notes: list[str] = field(default_factory=list)  # what a change means for the site
    written: list[Path] = field(default_factory=list)
    backups: list[Path] = field(default_factory=list)
    text: str = ""  # the main file's merged text (merge_text)


def _merge_docs(docs: list[_Doc], ns: Iterable[Need], many_prologs: bool,
                read: Callable[[str], Optional[str]] = _read_head) -> MergeResult:
    res = MergeResult()
    main = docs[0]
    appended: list[str] = []

    def where(a: _Assignment) -> str:
        name = docs[a.doc].path.name if docs[a.doc].path is not None else "slurm.conf"
        return f"{name} line {a.line + 1}"

    def set_value(a: _Assignment, new: str) -> None:
        doc = docs[a.doc]
        line = doc.lines[a.line]
        text = f'"{new}"' if a.quoted else new
        doc.lines[a.line] = line[:a.start] + text + line[a.end:]
        doc.changed = True

    assigns = _assignments(docs)
    by_key: dict[str, list[_Assignment]] = {}
    for a in assigns:
        by_key.setdefault(a.key.lower(), []).append(a)

    def last(key: str) -> Optional[_Assignment]:
        found = by_key.get(key.lower())
        return found[-1] if found else None

    storage = last("AccountingStorageType")
    slurmdbd = storage is not None and storage.value.strip() == SLURMDBD
    base_dir = main.path.parent if main.path is not None else None
    for n in ns:
        if n.accounting_only and not slurmdbd:
            continue
        a = last(n.key)
        if n.kind == LIST:
            missing = missing_members(n, a.value if a else None)
            if not missing:
                continue
            if a is None or not _members(a.value):
                if a is None:
                    appended.append(f"{n.key}={','.join(missing)}")
                    res.changes.append(f"{n.key}: not set -> {','.join(missing)} (added)")
                else:
                    set_value(a, ",".join(missing))
                    res.changes.append(f"{n.key}: {a.value or '(empty)'} -> {','.join(missing)} ({where(a)})")
                continue
            new = ",".join([*_members(a.value), *missing])
            set_value(a, new)
            res.changes.append(f"{n.key}: {a.value} -> {new} ({where(a)})")
        elif n.kind == SCALAR:
            want = n.values[0]
            if a is not None and a.value.strip().lower() == want.lower():
                continue
            if a is not None and not _unset_scalar(a.value):
                res.conflicts.append(f"{n.key}={a.value} ({where(a)}), slurm-antman needs {want}: {n.why}. Not "
                                     "changed: decide how your own preemption fits, set it, and merge again")
                continue
            if a is None:
                appended.append(f"{n.key}={want}")
                res.changes.append(f"{n.key}: not set -> {want} (added)")
            else:
                set_value(a, want)
                res.changes.append(f"{n.key}: {a.value} -> {want} ({where(a)})")
            if n.key == "PreemptType":
                res.notes.append("PreemptType=preempt/partition_prio: a job in a partition of higher PriorityTier "
                                 "may now preempt jobs of lower ones; give PreemptMode=OFF to your partitions that "
                                 "must never be preempted")
        elif n.kind == PREEMPT_MODE:
            if a is not None and preempt_base_mode(a.value) != "OFF":
                continue
            new = ",".join([*[m for m in _members(a.value if a else None) if m.upper() != "OFF"], "REQUEUE"])
            if a is None:
                appended.append(f"{n.key}={new}")
                res.changes.append(f"{n.key}: not set -> {new} (added)")
            else:
                set_value(a, new)
                res.changes.append(f"{n.key}: {a.value} -> {new} ({where(a)})")
        else:  # HOOK
            hook = n.values[0]
            found = [x for x in by_key.get(n.key.lower(), []) if _members(x.value)]
            if not found:
                appended.append(f"{n.key}={hook}")
                res.changes.append(f"{n.key}: not set -> {hook} (added)")
                continue
            # 24.11 runs every Prolog= line; an older Slurm only the last one.
            progs = [x.value.strip() for x in found] if many_prologs else [found[-1].value.strip()]
            runs, _ = hook_runs(n, progs, read, base_dir)
            if runs:
                continue
            if many_prologs:
                appended.append(f"{n.key}={hook}")
                res.changes.append(f"{n.key}: {', '.join(progs)} kept; {hook} added as another {n.key}= line")
                continue
            res.conflicts.append(f"{n.key}={found[-1].value} ({where(found[-1])}) does not run {hook}, and this Slurm "
                                 f"runs one {n.key}: call {hook} from it (keeping its exit status), then merge again")
    if appended:
        main.lines += ["", "# Added by `antman config merge-slurm-conf`: settings slurm-antman needs "
                           "(slurm.conf.needed says why)."] + appended
        main.changed = True
    return res


def merge_text(text: str, ns: Iterable[Need], many_prologs: bool = False) -> MergeResult:
    """``text`` (one slurm.conf, its Include lines not followed) with ``ns`` merged in; pure. The devcluster
    writes its own slurm.conf with it, as a site's admin runs merge-slurm-conf."""
    docs = [_Doc(None, text.splitlines())]
    res = _merge_docs(docs, ns, many_prologs)
    res.text = "\n".join(docs[0].lines) + "\n"
    return res


def merge_file(path: Path, ns: Iterable[Need], many_prologs: bool = False, dry_run: bool = False) -> MergeResult:
    """Merge ``ns`` into slurm.conf at ``path`` and the files it Includes (a key is changed where Slurm
    reads its last value). Nothing is written when any key conflicts or with ``dry_run``; each file
    written is backed up first as FILE.before-antman-TIMESTAMP."""
    docs = _read_docs(Path(path))
    res = _merge_docs(docs, ns, many_prologs)
    res.text = "\n".join(docs[0].lines) + "\n"
    if res.conflicts or dry_run:
        return res
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for doc in docs:
        if not doc.changed or doc.path is None:
            continue
        backup = doc.path.with_name(f"{doc.path.name}.before-antman-{stamp}")
        try:
            shutil.copy2(doc.path, backup)
            st = doc.path.stat()
            tmp = doc.path.with_name(f".{doc.path.name}.antman-tmp")
            tmp.write_text("\n".join(doc.lines) + "\n")
            shutil.copystat(doc.path, tmp)
            if os.geteuid() == 0:
                os.chown(tmp, st.st_uid, st.st_gid)
            tmp.replace(doc.path)
        except OSError as e:
            raise MergeError(f"cannot write {doc.path}: {e.strerror or e}") from None
        res.backups.append(backup)
        res.written.append(doc.path)
    return res


def merge_command(cfg: AntmanConfig, slurm_conf: Optional[str], hook_dir: Optional[str], dry_run: bool) -> int:
    """``antman config merge-slurm-conf``: 0 merged (or nothing to do), 1 a conflict (nothing written),
    2 a usage or file error."""
    import sys

    from slurm_antman.slurm import version as slurm_version
    from slurm_antman.slurm.errors import SlurmError

    if not hook_dir or not hook_dir.startswith("/"):
        print("antman config merge-slurm-conf: give --hook-dir, the absolute directory `antman config render "
              "--hook-dir` put antman-prolog and antman-epilog in (slurm.conf names them as Prolog=/Epilog=)",
              file=sys.stderr)
        return 2
    path = Path(slurm_conf or os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")
    try:
        many = slurm_version.many_prolog_lines(slurm_version.installed_version(
            commands=slurm_version.DAEMON_FIRST))
    except SlurmError:
        many = False  # the Slurm here cannot say: one Prolog, the side that never drops the site's
    try:
        res = merge_file(path, needs(cfg, hook_dir), many_prologs=many, dry_run=dry_run)
    except MergeError as e:
        print(f"antman config merge-slurm-conf: {e}", file=sys.stderr)
        return 2
    for c in res.conflicts:
        print(f"CONFLICT {c}")
    if res.conflicts:
        print(f"{path}: not changed ({len(res.conflicts)} conflict(s)); the changes it would make otherwise:")
    for c in res.changes:
        print(f"  {c}")
    for n in res.notes:
        print(f"  note: {n}")
    if res.conflicts:
        return 1
    if not res.changes:
        print(f"{path}: already has every setting slurm-antman needs")
    elif dry_run:
        print(f"{path}: not changed (--dry-run)")
    else:
        for w, b in zip(res.written, res.backups):
            print(f"{w}: merged (the original is {b})")
        print("then: scontrol reconfigure, or restart slurmctld and every slurmd where GresTypes, PreemptType, "
              "the plugins or PrologFlags changed")
    return 0
