"""Parsers for the text and JSON that Slurm's commands print (22.05 and 24.11). Pure functions, no I/O.

``scontrol show job -o`` prints ``Key=Value`` pairs joined by spaces, and several values are free
text that may themselves contain spaces and ``Other=`` (a job name, ``--comment``, the command line,
the working directory). Splitting on spaces, or on every ``Word=``, would let a user's comment
forge fields. Slurm prints keys in a fixed order, so :func:`parse_scontrol_line` picks the reading
whose keys follow that order and that recognises the most keys, preferring later boundaries: real
keys always come after any look-alike inside a user's value.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, Iterable, Optional

from .. import hostlist
from .errors import SlurmOutputError
from .models import Association, Job, Node
from .tag import AntmanTag, read_admin_comment

# Order of `scontrol show job` keys in Slurm 22.05 (src/api/job_info.c); optional ones included.
# 24.11 prints ReqTRES= and AllocTRES= where 22.05 prints TRES=; 25.11 adds SubmitLine= (the sbatch command
# line verbatim, newlines included: src/scontrol/info_job.c), read from JSON there (version.job_show_json).
JOB_KEY_ORDER: tuple[str, ...] = (
    "JobId", "ArrayJobId", "ArrayTaskId", "ArrayTaskThrottle", "HetJobId", "HetJobOffset", "HetJobIdSet",
    "JobName", "UserId", "GroupId", "MCS_label", "Priority", "Nice", "Account", "QOS", "WCKey",
    "JobState", "Reason", "FailedNode", "Dependency", "Requeue", "Restarts", "BatchFlag", "Reboot",
    "ExitCode", "DerivedExitCode", "RunTime", "TimeLimit", "TimeMin", "SubmitTime", "EligibleTime",
    "AccrueTime", "StartTime", "EndTime", "Deadline", "PreemptEligibleTime", "PreemptTime",
    "SuspendTime", "SecsPreSuspend", "LastSchedEval", "Scheduler", "ResizeTime", "Partition",
    "AllocNode:Sid", "ReqNodeList", "ExcNodeList", "NodeList", "SchedNodeList", "BatchHost",
    "NumNodes", "NumCPUs", "NumTasks", "CPUs/Task", "ReqB:S:C:T", "TRES", "ReqTRES", "AllocTRES", "Socks/Node",
    "NtasksPerN:B:S:C", "CoreSpec", "ThreadSpec", "JOB_GRES", "Nodes", "CPU_IDs", "Mem", "GRES",
    "MinCPUsNode", "MinMemoryNode", "MinMemoryCPU", "MinTmpDiskNode", "Features", "ClusterFeatures",
    "Prefer", "BatchFeatures", "Reservation", "DelayBoot", "OverSubscribe", "Contiguous", "Licenses",
    "Network", "Command", "SubmitLine", "WorkDir", "AdminComment", "SystemComment", "Comment", "StdErr", "StdIn",
    "StdOut", "BurstBuffer", "BurstBufferState", "CpuFreqMin", "CpuFreqMax", "CpuFreqGov",
    "Switches", "Wait-for-Switch", "Power", "MailUser", "MailType", "TresBind", "TresFreq",
    "CpusPerTres", "MemPerTres", "TresPerJob", "TresPerNode", "TresPerSocket", "TresPerTask",
    "NtasksPerTRES",
)
_ORDER = {k: i for i, k in enumerate(JOB_KEY_ORDER)}
# Values that are user or admin text and may contain spaces (and look-alike keys).
FREE_TEXT_KEYS = frozenset({
    "JobName", "Command", "SubmitLine", "WorkDir", "AdminComment", "SystemComment", "Comment", "StdErr", "StdIn",
    "StdOut", "Reason", "MailUser", "Features", "Prefer", "BatchFeatures", "Licenses",
})
# The per-node allocation lines of `-d` (Nodes= CPU_IDs= Mem= GRES=) repeat once per node.
_NODE_BLOCK = ("Nodes", "CPU_IDs", "Mem", "GRES")

_KEY_RE = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/\-]*)=")


def _allowed(prev_order: int, key: str) -> bool:
    order = _ORDER.get(key)
    if order is None:
        return False
    if order > prev_order:
        return True
    return key == "Nodes" and _ORDER["Nodes"] <= prev_order <= _ORDER["GRES"]


def parse_scontrol_line(line: str) -> list[tuple[str, str]]:
    """``scontrol show <entity> -o`` one-line output -> ordered ``(key, value)`` pairs (keys may repeat).

    Unknown keys (a newer Slurm) are kept when they follow a value without spaces; values of known
    free-text keys extend up to the next key that may follow them in Slurm's order.
    """
    line = line.rstrip("\n")
    cands = [(m.start(), m.end(), m.group(1)) for m in _KEY_RE.finditer(line)]
    if not cands or cands[0][0] != len(line) - len(line.lstrip()):
        raise SlurmOutputError(f"not a key=value line: {line[:200]!r}")
    n = len(cands)

    @lru_cache(maxsize=None)
    def best(i: int, prev_order: int) -> Optional[tuple[int, tuple[int, ...]]]:
        """Best reading of cands[i:] given the order reached so far: (keys read, chosen indices)."""
        key = cands[i][2]
        order = _ORDER.get(key, prev_order)
        if key in FREE_TEXT_KEYS:
            options = [j for j in range(i + 1, n) if _allowed(order, cands[j][2])]
        else:
            options = [i + 1] if i + 1 < n else []
            value = line[cands[i][1]: cands[i + 1][0] if i + 1 < n else len(line)].strip()
            if i + 1 < n and (" " in value or not (_allowed(order, cands[i + 1][2])
                                                    or cands[i + 1][2] not in _ORDER)):
                # A space inside a value that is not free text means cands[i+1] is not a real key
                # boundary for this reading.
                return None
        result: Optional[tuple[int, tuple[int, ...]]] = (1, (i,))  # this key's value runs to the end
        if key not in FREE_TEXT_KEYS and options:
            result = None
        for j in options:
            sub = best(j, order)
            if sub is None:
                continue
            cand = (sub[0] + 1, (i,) + sub[1])
            # Ties go to the later boundary: `>=` because options are scanned in increasing j.
            if result is None or cand[0] >= result[0]:
                result = cand
        return result

    found = best(0, -1)
    if found is None:
        raise SlurmOutputError(f"cannot split scontrol output into fields: {line[:200]!r}")
    chosen = found[1]
    pairs = []
    for k, i in enumerate(chosen):
        end = cands[chosen[k + 1]][0] if k + 1 < len(chosen) else len(line)
        pairs.append((cands[i][2], line[cands[i][1]:end].strip()))
    return pairs


def _null(v: Optional[str]) -> str:
    return "" if v in (None, "(null)", "N/A", "None") else v


_IDX_RE = re.compile(r"\(IDX:([^)]*)\)")


_GRES_PREFIX = re.compile(r"^gres[:/]")


def gres_prefix(tres: str) -> str:
    """The GRES prefix a TRES string uses: ``gres:`` (22.05: ``gres:gpu:2``) or ``gres/`` (24.11:
    ``gres/gpu:2``); ``gres:`` when it names none. Write back in the form read."""
    for entry in (tres or "").split(","):
        m = _GRES_PREFIX.match(entry.strip())
        if m:
            return m.group(0)
    return "gres:"


def tres_body(tres: str) -> str:
    """``gres/gpu:2,gres/nic:1`` or ``gres:gpu:2,gres:nic:1`` -> ``gpu:2,nic:1``: one form to compare."""
    return ",".join(_GRES_PREFIX.sub("", e.strip()) for e in (tres or "").split(",") if e.strip())


def gres_count(tres: str, names: tuple[str, ...]) -> int:
    """GPUs per node in a TresPerNode string (``gres:gpu:2`` / ``gres:gpu:a100:2`` / ``gpu:2``; 24.11
    writes ``gres/gpu:2``)."""
    total = 0
    for entry in filter(None, tres_body(tres).split(",")):
        parts = entry.split(":")
        if parts[0] in names:
            total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


def gres_types(tres: str, names: tuple[str, ...]) -> set[str]:
    """The GPU types named in a TresPerNode string's GPU-like entries (``gres:gpu:h100:2`` -> {"h100"})."""
    types = set()
    for entry in filter(None, tres_body(tres).split(",")):
        parts = entry.split(":")
        if parts[0] in names and len(parts) >= 2 and not (len(parts) == 2 and parts[1].isdigit()):
            types.add(parts[1])
    return types


def split_gres(spec: str) -> list[str]:
    """``gpu:2(IDX:0,2),antman_opp:1`` -> ``["gpu:2(IDX:0,2)", "antman_opp:1"]`` (commas in () kept)."""
    parts, depth, cur = [], 0, []
    for ch in spec or "":
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip() and p.strip() not in ("(null)", "N/A")]


def parse_index_list(text: str) -> list[int]:
    """``0-1,3`` -> ``[0, 1, 3]``."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmOutputError(f"bad GRES index range {part!r} in {text!r}")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


def gres_indices(spec: str, gres_name: str = "gpu") -> list[int]:
    """The device indices of GRES ``gres_name`` in a job's per-node GRES (``gpu:2(IDX:0-1)``,
    ``gpu:a100:1(IDX:3)``); count-only GRES have no indices and give ``[]``."""
    out: list[int] = []
    for item in split_gres(spec):
        name = item.split(":", 1)[0].removeprefix("gres/")
        m = _IDX_RE.search(item)
        if name == gres_name and m:
            out.extend(parse_index_list(m.group(1)))
    return out


def gres_counts(spec: str) -> dict[str, int]:
    """``gpu:4,antman_opp:8`` or ``gpu:a100:3(IDX:0-2)`` -> ``{"gpu": 4, ...}`` (typed GRES summed)."""
    out: dict[str, int] = {}
    for item in split_gres(spec):
        base = re.sub(r"\(.*\)$", "", item)
        fields = base.split(":")
        name = fields[0].removeprefix("gres/")
        count = int(fields[-1]) if len(fields) > 1 and fields[-1].isdigit() else 1
        out[name] = out.get(name, 0) + count
    return out


# The tag is jobtag's to parse; Slurm's readers take its tolerant reading (class "none" and a problem
# for a damaged tag), so that one odd job never stops a listing.
parse_admin_comment = read_admin_comment


def normalise_state(state: Any) -> str:
    """``RUNNING``, ``["RUNNING"]`` (newer JSON), ``CANCELLED by 0`` -> ``RUNNING`` / ``CANCELLED``."""
    if isinstance(state, (list, tuple)):
        state = state[0] if state else ""
    text = str(state or "").strip().upper()
    return text.split()[0].rstrip("+") if text else "UNKNOWN"


def parse_slurm_time(value: Any) -> Optional[datetime]:
    """Epoch seconds (JSON) or ``2026-11-20T23:41:51`` local time (scontrol); 0/Unknown -> None."""
    if isinstance(value, dict):  # newer JSON: {"set": true, "number": N}
        value = value.get("number") if value.get("set", True) else None
    if value in (None, "", 0, "Unknown", "None", "N/A"):
        return None
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, tz=timezone.utc).astimezone()
    try:
        return datetime.fromisoformat(str(value)).astimezone()
    except ValueError:
        return None


def _expand_nodes(nodelist: str) -> list[str]:
    nodelist = _null(nodelist)
    if not nodelist:
        return []
    try:
        return hostlist.expand(nodelist)
    except hostlist.HostlistError:
        return [nodelist]


def _physical_gpus(tag: AntmanTag, gres_by_node: dict[str, list[int]]) -> dict[str, list[int]]:
    if tag.job_class == "opportunistic":
        return {n: list(i) for n, i in tag.gpus_by_node.items()}
    return {n: i for n, i in gres_by_node.items() if i}


def _user(text: str) -> str:
    """``root(0)`` -> ``root``."""
    return re.sub(r"\(\d+\)$", "", _null(text))


_TASK_RANGE = re.compile(r"^\d+([-,:]\d+)*$")


def array_task_of(array_job_id: object, task: object) -> tuple[Optional[int], Optional[str]]:
    """(array id, task) from Slurm's fields; (None, None) for a job that is no array task. ``task`` is
    an index, or the pending rest's range as scontrol/squeue print it ("2-5%2": the throttle goes)."""
    if isinstance(array_job_id, dict):  # 24.11 JSON: {"set": true, "number": N}
        array_job_id = array_job_id.get("number") if array_job_id.get("set", True) else None
    if isinstance(task, dict):
        task = task.get("number") if task.get("set", True) else None
    try:
        aid = int(str(array_job_id))
    except ValueError:
        return None, None
    if aid <= 0 or task is None:
        return None, None
    text = str(task).split("%", 1)[0].strip()
    if not _TASK_RANGE.match(text) or (text.isdigit() and int(text) >= NO_VAL_32):
        return None, None
    return aid, text


NO_VAL_32 = 4294967294


def job_from_scontrol(line: str, gres_name: str = "gpu") -> Job:
    pairs = parse_scontrol_line(line)
    fields: dict[str, str] = {}
    gres_by_node: dict[str, list[int]] = {}
    block_nodes: list[str] = []
    for k, v in pairs:
        if k == "Nodes":
            block_nodes = _expand_nodes(v)
        elif k == "GRES" and block_nodes:
            for node in block_nodes:
                gres_by_node[node] = gres_indices(v, gres_name)
        elif k not in _NODE_BLOCK:
            fields.setdefault(k, v)
    if "JobId" not in fields or not fields["JobId"].isdigit():
        raise SlurmOutputError(f"scontrol output has no numeric JobId: {line[:200]!r}")
    tag = parse_admin_comment(fields.get("AdminComment"))
    try:
        restarts = int(fields.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    return Job(
        job_id=int(fields["JobId"]), name=_null(fields.get("JobName")), user=_user(fields.get("UserId", "")),
        account=_null(fields.get("Account")), partition=_null(fields.get("Partition")),
        state=normalise_state(fields.get("JobState")), reason=_null(fields.get("Reason")),
        nodelist=_null(fields.get("NodeList")), nodes=_expand_nodes(fields.get("NodeList", "")),
        restarts=restarts, admin_comment=_null(fields.get("AdminComment")),
        comment=_null(fields.get("Comment")), antman_class=tag.job_class,
        gpus_by_node=_physical_gpus(tag, gres_by_node), tres_per_node=_null(fields.get("TresPerNode")),
        submit_time=parse_slurm_time(fields.get("SubmitTime")),
        start_time=parse_slurm_time(fields.get("StartTime")),
        excluded_nodes=_expand_nodes(_null(fields.get("ExcNodeList"))), raw=fields, tag_reading=tag,
        **dict(zip(("array_job_id", "array_task"), array_task_of(fields.get("ArrayJobId", ""),
                                                                 fields.get("ArrayTaskId")))),
    )


def job_from_squeue_json(j: dict, gres_name: str = "gpu") -> Job:
    """One element of ``squeue --json``'s ``jobs`` (data_parser v0.0.38 in 22.05, v0.0.42 in 24.11)."""
    if not isinstance(j, dict) or not isinstance(j.get("job_id"), int):
        raise SlurmOutputError(f"squeue --json job entry without an integer job_id: {str(j)[:200]}")
    nodes = _expand_nodes(j.get("nodes") or "")
    # gres_detail lists one entry per allocated node, in the order of job_resources' allocated nodes:
    # 22.05 `allocated_nodes[].nodename`, 24.11 `nodes.allocation[].name`.
    res = j.get("job_resources") or {}
    alloc = res.get("allocated_nodes") or []
    alloc_names = [a.get("nodename") for a in alloc if isinstance(a, dict)]
    if not alloc_names and isinstance(res.get("nodes"), dict):
        alloc_names = [a.get("name") for a in res["nodes"].get("allocation") or [] if isinstance(a, dict)]
    alloc_names = alloc_names or nodes
    details = j.get("gres_detail") or []
    gres_by_node = {node: gres_indices(d, gres_name) for node, d in zip(alloc_names, details)}
    tag = parse_admin_comment(j.get("admin_comment"))
    start = j.get("start_time")
    state = normalise_state(j.get("job_state"))
    return Job(
        job_id=j["job_id"], name=j.get("name") or "", user=j.get("user_name") or str(j.get("user_id", "")),
        account=j.get("account") or "", partition=j.get("partition") or "", state=state,
        reason=_null(j.get("state_reason")), nodelist=j.get("nodes") or "", nodes=nodes,
        restarts=int(j.get("restart_cnt") or 0), admin_comment=j.get("admin_comment") or "",
        comment=j.get("comment") or "", antman_class=tag.job_class,
        gpus_by_node=_physical_gpus(tag, gres_by_node), tres_per_node=j.get("tres_per_node") or "",
        submit_time=parse_slurm_time(j.get("submit_time")),
        # A pending job's start_time is Slurm's estimate; report it only once it has started.
        start_time=parse_slurm_time(start) if state not in ("PENDING",) else None,
        excluded_nodes=_expand_nodes(j.get("excluded_nodes") or ""), raw=j, tag_reading=tag,
        **dict(zip(("array_job_id", "array_task"), array_task_of(
            j.get("array_job_id", 0),
            j.get("array_task_id") if j.get("array_task_id") is not None else (j.get("array_task_string") or None)))),
    )


def jobs_from_squeue_json(doc: dict, gres_name: str = "gpu") -> list[Job]:
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise SlurmOutputError("squeue --json output has no 'jobs' list")
    return [job_from_squeue_json(j, gres_name) for j in doc["jobs"]]


def node_from_sinfo_json(n: dict) -> Node:
    state = n.get("state", "")
    flags = list(n.get("state_flags") or [])
    if isinstance(state, list):  # newer JSON: ["IDLE", "DRAIN"]
        state, flags = (state[0] if state else ""), list(state[1:]) + flags
    return Node(
        name=n.get("name", ""), state=str(state).upper(), state_flags=[str(f).upper() for f in flags],
        gres=gres_counts(n.get("gres", "")), gres_used=gres_counts(n.get("gres_used", "")),
        partitions=list(n.get("partitions") or []), cpus=int(n.get("cpus") or 0),
        alloc_cpus=int(n.get("alloc_cpus") or 0), real_memory_mb=int(n.get("real_memory") or 0),
        reason=n.get("reason") or "", raw=n,
    )


def nodes_from_sinfo_json(doc: dict) -> list[Node]:
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise SlurmOutputError("sinfo/scontrol --json output has no 'nodes' list")
    seen: dict[str, Node] = {}
    for n in doc["nodes"]:
        node = node_from_sinfo_json(n)
        seen.setdefault(node.name, node)  # sinfo lists a node once per partition in some versions
    return list(seen.values())


def filter_jobs(jobs: Iterable[Job], states: Optional[Iterable[str]] = None,
                users: Optional[Iterable[str]] = None, job_ids: Optional[Iterable[int]] = None) -> list[Job]:
    """Client-side filtering: ``squeue --json`` in 22.05 ignores -t/-u/-j (one path for every version)."""
    st = {normalise_state(s) for s in states} if states is not None else None
    us = set(users) if users is not None else None
    ids = {int(i) for i in job_ids} if job_ids is not None else None
    return [j for j in jobs if (st is None or j.state in st) and (us is None or j.user in us)
            and (ids is None or j.job_id in ids)]


# `sacctmgr -n -P show associations format=...`: one row per association, fields joined by "|" (no
# Slurm name may contain "|", so the split cannot be forged by an account or user name).
ASSOC_FORMAT = ("Cluster", "Account", "User", "ParentName", "GrpTRES")


def parse_tres(text: str) -> dict[str, str]:
    """``cpu=10,gres/gpu=4`` -> ``{"cpu": "10", "gres/gpu": "4"}``; an empty text is no limit."""
    out: dict[str, str] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SlurmOutputError(f"TRES item {item!r} is not NAME=VALUE")
        out[name] = value
    return out


def associations_from_sacctmgr(text: str) -> list[Association]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("|")
        if fields and fields[-1] == "" and len(fields) == len(ASSOC_FORMAT) + 1:
            fields.pop()  # some versions end each parsable row with a "|"
        if len(fields) != len(ASSOC_FORMAT):
            raise SlurmOutputError(f"sacctmgr association row {n} has {len(fields)} fields, expected "
                                   f"{len(ASSOC_FORMAT)} ({', '.join(ASSOC_FORMAT)}): {line[:120]!r}")
        cluster, account, user, parent, tres = (f.strip() for f in fields)
        try:
            grp = parse_tres(tres)
        except SlurmOutputError as e:
            raise SlurmOutputError(f"sacctmgr association row {n} (account {account!r}): GrpTRES {e}") from None
        rows.append(Association(cluster, account, user, parent, grp))
    return rows


def parse_scontrol_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Name   = value`` lines; a header or an empty value is skipped/kept as ''.
    24.11 prints the settings that may be lists once per item (``Prolog[0] = /a``, ``Prolog[1] = /b``);
    they are read as one ``Prolog`` = ``/a,/b``, the way 22.05 prints its single value."""
    conf: dict[str, str] = {}
    items: dict[str, list[tuple[int, str]]] = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+)\s+=\s?(.*)$", line)
        if not m:
            continue
        key, value = m.group(1), m.group(2).strip()
        indexed = re.match(r"^(\w+)\[(\d+)\]$", key)
        if indexed:
            items.setdefault(indexed.group(1), []).append((int(indexed.group(2)), value))
        else:
            conf[key] = value
    for key, values in items.items():
        conf.setdefault(key, ",".join(v for _, v in sorted(values)))
    return conf


_SDIAG_TIME = re.compile(r"sdiag output at .*\((\d+)\)")


def sdiag_time(text: str) -> float:
    """The Unix time ``sdiag`` says slurmctld answered at (``sdiag output at Thu Nov 26 ... (1795000000)``)."""
    m = _SDIAG_TIME.search(text)
    if not m:
        raise SlurmOutputError("sdiag printed no time")
    return float(m.group(1))
