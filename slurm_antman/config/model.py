"""The model of ``antman.yaml``: one pydantic model that every component reads (loader.py reads the file
into it and words its errors)."""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import hostlist

_SLURM_NAME = r"^[A-Za-z][A-Za-z0-9_\-]*$"


class JobClass(str, enum.Enum):
    guaranteed = "guaranteed"
    opportunistic = "opportunistic"
    auto = "auto"


class DefaultClass(str, enum.Enum):
    """What a job without ``--antman`` becomes. ``none`` leaves it to plain Slurm."""

    none = "none"
    guaranteed = "guaranteed"
    opportunistic = "opportunistic"


class _Strict(BaseModel):
    # strict: a value of the wrong type is an error, never converted (YAML's `true` is not GraceTime=1,
    # the text "8" is not 8, 123 is not the name "123"). pydantic's strict mode still takes an integer
    # where a float belongs: 1 for 1.0 loses nothing, and admins write `heartbeat_s: 1`.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def expand_file_pattern(pattern: str) -> list[str]:
    """gres.conf's ``File=`` form: ``/dev/nvidia[0-3,6]`` or a comma list of such."""
    out: list[str] = []
    for part in (p for p in re.split(r",(?![^\[]*\])", pattern) if p):
        m = re.fullmatch(r"(.*)\[([0-9,\-]+)\](.*)", part)
        if not m:
            out.append(part)
            continue
        for name in hostlist.expand(f"x[{m.group(2)}]"):
            out.append(f"{m.group(1)}{name[1:]}{m.group(3)}")
    return out


class NodeGroup(_Strict):
    name: str = Field(description="Slurm hostlist of GPU nodes, e.g. gpu[01-16].")
    gpus: int = Field(ge=1, le=64, description="Physical GPUs per node.")
    cpus: int = Field(default=8, ge=1, description="CPUs per node (slurm.conf CPUs=).")
    memory_mb: int = Field(default=16000, ge=1, description="RealMemory per node in MiB.")
    gpu_memory_mb: int = Field(default=81920, ge=1, description="Memory of each GPU in MiB.")
    gpu_files: Optional[str] = Field(
        default=None,
        description="Device files for the gpu GRES, e.g. /dev/nvidia[0-7]. Default: /dev/nvidia[0-N].",
    )
    slurm_params: Optional[str] = Field(
        default=None, pattern=r"^[A-Za-z]+=\S+( [A-Za-z]+=\S+)*$",
        description="Extra words for these nodes' NodeName= lines, e.g. 'Sockets=2 CoresPerSocket=32'.",
    )
    gpu_type: Optional[str] = Field(
        default=None, pattern=_SLURM_NAME,
        description="GPU type of these nodes, e.g. h100: Gres=gpu:h100:N and gres.conf Type=h100, so jobs may ask "
                    "for --gres=gpu:h100:N; their opportunistic slots carry the type too, so an opportunistic "
                    "--gres=gpu:h100:1 runs on one of these nodes. null: untyped.")

    @field_validator("name")
    @classmethod
    def _hostlist(cls, v: str) -> str:
        try:
            hostlist.expand(v)
        except hostlist.HostlistError as e:
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _files_match_gpus(self) -> "NodeGroup":
        if self.gpu_files is not None:
            try:
                n = len(expand_file_pattern(self.gpu_files))
            except hostlist.HostlistError as e:
                raise ValueError(f"gpu_files: {e}") from None
            if n != self.gpus:
                raise ValueError(f"gpu_files {self.gpu_files!r} names {n} device file(s) but gpus is {self.gpus}: "
                                 "one file per GPU")
        return self

    @property
    def hosts(self) -> list[str]:
        return hostlist.expand(self.name)

    @property
    def gpu_device_paths(self) -> list[str]:
        """One device file per GPU, in Slurm's GRES index order (gres.conf's ``File=`` order)."""
        pattern = self.gpu_files or (f"/dev/nvidia[0-{self.gpus - 1}]" if self.gpus > 1 else "/dev/nvidia0")
        return expand_file_pattern(pattern)


class Tenant(_Strict):
    account: str = Field(description="Slurm account of the tenant.")
    guaranteed_gpus: int = Field(ge=0, description="GPUs the tenant may hold as guaranteed at once.")

    @field_validator("account")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.match(_SLURM_NAME, v):
            raise ValueError(f"{v!r} is not a Slurm account name (letters, digits, '_' and '-')")
        return v


# Slurm's time limits (slurm.conf(5) MaxTime=): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
_SLURM_TIME = re.compile(r"^(?:(?P<m>\d+)(?::(?P<ms>\d{1,2}))?|(?P<h>\d+):(?P<hm>\d{1,2}):(?P<hs>\d{1,2})"
                         r"|(?P<d>\d+)-(?P<dh>\d{1,2})(?::(?P<dm>\d{1,2})(?::(?P<ds>\d{1,2}))?)?)$")
_NO_LIMIT = ("INFINITE", "UNLIMITED")


def slurm_time_minutes(text: str) -> Optional[int]:
    """``7-00:00:00`` -> 10080; INFINITE/UNLIMITED -> None (no limit); seconds round up, as Slurm does.
    ValueError naming the accepted forms for anything else."""
    if text.upper() in _NO_LIMIT:
        return None
    m = _SLURM_TIME.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a Slurm time; use minutes ('90'), 'HH:MM:SS', 'D-HH:MM:SS' (e.g. "
                         "'7-00:00:00') or INFINITE")
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    seconds = (g.get("m", 0) * 60 + g.get("ms", 0) + g.get("h", 0) * 3600 + g.get("hm", 0) * 60 + g.get("hs", 0)
               + g.get("d", 0) * 86400 + g.get("dh", 0) * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0))
    return -(-seconds // 60)


# Keys of a PartitionName= line that slurm-antman writes itself: from typed fields, or its own to decide.
_PARTITION_OWNED = {
    "partitionname": "the partition's name is slurm.guaranteed_partition / opportunistic_partition",
    "nodes": "slurm-antman puts every GPU node of antman.yaml in both partitions",
    "prioritytier": "the two partitions' tiers are what lets guaranteed jobs preempt opportunistic ones",
    "preemptmode": "guaranteed jobs are never preempted, opportunistic ones are requeued",
    "gracetime": "set grace_time_s",
    "state": "the partitions are rendered UP",
    "default": "set default (or slurm.default_partition)",
    "maxtime": "set max_time", "defaulttime": "set default_time",
    "allowaccounts": "set allow_accounts", "denyaccounts": "set deny_accounts",
    "allowgroups": "set allow_groups", "allowqos": "set allow_qos", "denyqos": "set deny_qos",
    "qos": "set qos", "maxnodes": "set max_nodes",
}


def _names(v: Optional[list[str]], what: str, one: str) -> Optional[list[str]]:
    if v is None:
        return v
    if not v:
        raise ValueError(f"an empty list of {what} would let nobody in; leave it out (null) for no restriction")
    for name in v:
        if not re.match(_SLURM_NAME, name):
            raise ValueError(f"{name!r} is not a Slurm {one} name (letters, digits, '_' and '-')")
    if len(set(v)) != len(v):
        raise ValueError(f"{what} listed twice: {', '.join(sorted({n for n in v if v.count(n) > 1}))}")
    return v


class PartitionOptions(_Strict):
    """What a site sets on a partition, rendered onto its PartitionName= line; unset fields are left to Slurm."""

    max_time: str = Field(default="INFINITE",
                          description="MaxTime=: the longest time limit a job may have ('7-00:00:00', minutes, "
                                      "INFINITE). Quote it: YAML reads 1:30 as a number.")
    default_time: Optional[str] = Field(default=None, description="DefaultTime=: a job's time limit when it gives "
                                                                   "none; at most max_time.")
    default: Optional[bool] = Field(default=None, description="Default=YES/NO; null: YES for the partition named "
                                                              "by slurm.default_partition.")
    allow_accounts: Optional[list[str]] = Field(default=None, description="AllowAccounts=: only these accounts may "
                                                                          "use it; null: all.")
    deny_accounts: Optional[list[str]] = Field(default=None, description="DenyAccounts=: these accounts may not.")
    allow_groups: Optional[list[str]] = Field(default=None, description="AllowGroups=: only these Unix groups.")
    allow_qos: Optional[list[str]] = Field(default=None, description="AllowQos=: only these QOS; null: all.")
    deny_qos: Optional[list[str]] = Field(default=None, description="DenyQos=: these QOS may not.")
    qos: Optional[str] = Field(default=None, pattern=_SLURM_NAME, description="QOS=: the partition's own QOS, "
                                                                              "whose limits apply to its jobs.")
    max_nodes: Optional[int] = Field(default=None, ge=1, description="MaxNodes=: nodes one job may use.")
    slurm_params: Optional[str] = Field(
        default=None, pattern=r"^[A-Za-z]+=\S+( [A-Za-z]+=\S+)*$",
        description="Any other words for the PartitionName= line, e.g. 'OverSubscribe=NO ExclusiveUser=YES'.")

    @field_validator("max_time", "default_time")
    @classmethod
    def _time(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            slurm_time_minutes(v)
        return v

    @field_validator("allow_accounts", "deny_accounts")
    @classmethod
    def _accounts(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        return _names(v, "accounts", "account")

    @field_validator("allow_groups")
    @classmethod
    def _groups(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        return _names(v, "groups", "group")

    @field_validator("allow_qos", "deny_qos")
    @classmethod
    def _qos(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        return _names(v, "QOS", "QOS")

    @field_validator("slurm_params")
    @classmethod
    def _not_owned(cls, v: Optional[str]) -> Optional[str]:
        for word in (v or "").split():
            key = word.split("=", 1)[0]
            if key.lower() in _PARTITION_OWNED:
                raise ValueError(f"{key}= is not for slurm_params: {_PARTITION_OWNED[key.lower()]}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "PartitionOptions":
        if self.allow_accounts is not None and self.deny_accounts is not None:
            raise ValueError("allow_accounts and deny_accounts exclude each other (Slurm ignores DenyAccounts "
                             "once AllowAccounts is set); keep one")
        if self.allow_qos is not None and self.deny_qos is not None:
            raise ValueError("allow_qos and deny_qos exclude each other; keep one")
        if self.default_time is not None:
            most, default = slurm_time_minutes(self.max_time), slurm_time_minutes(self.default_time)
            if most is not None and (default is None or default > most):
                raise ValueError(f"default_time {self.default_time!r} is longer than max_time {self.max_time!r}")
        return self


class Partitions(_Strict):
    guaranteed: PartitionOptions = Field(default_factory=PartitionOptions,
                                         description="Options of slurm.guaranteed_partition.")
    opportunistic: PartitionOptions = Field(default_factory=PartitionOptions,
                                            description="Options of slurm.opportunistic_partition.")

    @model_validator(mode="after")
    def _one_default(self) -> "Partitions":
        if self.guaranteed.default and self.opportunistic.default:
            raise ValueError("guaranteed.default and opportunistic.default are both true; Slurm has one default "
                             "partition")
        return self


class SlurmNames(_Strict):
    gpu_gres: str = Field(default="gpu", pattern=_SLURM_NAME, description="GRES name of physical GPUs.")
    opportunistic_gres: str = Field(
        default="antman_opp", pattern=_SLURM_NAME,
        description="Count-only GRES that stands for opportunistic GPU slots.",
    )
    guaranteed_partition: str = Field(default="gpu", pattern=_SLURM_NAME)
    opportunistic_partition: str = Field(default="opportunistic", pattern=_SLURM_NAME)
    opportunistic_qos: Optional[str] = Field(default=None, description="QOS given to opportunistic jobs; none keeps "
                                                                         "the job's own.")
    default_partition: str = Field(
        default="gpu", pattern=_SLURM_NAME,
        description="Partition marked Default=YES (unless partitions.*.default says otherwise); a name other "
                    "than the two leaves both Default=NO (a partition of the site's is the default).")
    partitions: Partitions = Field(default_factory=Partitions,
                                   description="Options of the two partitions (time limits, who may use them).")
    backend: Literal["auto", "cli", "pyslurm"] = Field(default="auto", description=(
        "How the coordinator reads Slurm's jobs each cycle. auto: pyslurm where the one installed was built for the "
        "running Slurm (11 ms against the CLI's 125 ms for 120 jobs on 25.11: docs/benchmarks.md, \"The Slurm "
        "adapter\"), else the CLI; cli; pyslurm: or refuse to start. Hooks keep the CLI (cheaper in a new process)."))

    @model_validator(mode="after")
    def _distinct(self) -> "SlurmNames":
        if self.gpu_gres == self.opportunistic_gres:
            raise ValueError("gpu_gres and opportunistic_gres must differ")
        if self.guaranteed_partition == self.opportunistic_partition:
            raise ValueError("guaranteed_partition and opportunistic_partition must differ")
        allowed = self.partitions.opportunistic.allow_qos
        if self.opportunistic_qos is not None and allowed is not None and self.opportunistic_qos not in allowed:
            raise ValueError(f"opportunistic_qos {self.opportunistic_qos!r} is not in partitions.opportunistic."
                             f"allow_qos ({', '.join(allowed)}): every opportunistic job would be refused")
        return self

    def partition_default(self, which: str) -> bool:
        """Default=YES for ``which`` (guaranteed | opportunistic)."""
        opts: PartitionOptions = getattr(self.partitions, which)
        if opts.default is not None:
            return opts.default
        other: PartitionOptions = getattr(self.partitions, "opportunistic" if which == "guaranteed" else "guaranteed")
        if other.default:
            return False
        name = self.guaranteed_partition if which == "guaranteed" else self.opportunistic_partition
        return self.default_partition == name


class Opportunistic(_Strict):
    # 3: the Philly trace replayed whole queued opportunistic jobs half as long as with 2 (mean JCT
    # 16,242 s against 17,562 s), the window alike or a little better, guaranteed jobs as untouched
    # (docs/evaluation.md, "How many opportunistic jobs a GPU hosts", 2026-11-26). The placement rules,
    # not this bound, decide where a job fits; this caps the GPU's mix and Slurm's count-only GRES.
    slots_per_gpu: int = Field(default=3, ge=1, le=16, description="Opportunistic jobs one GPU may host.")
    utilization_threshold: float = Field(
        default=0.8, gt=0, le=1, description="A GPU busier than this takes no new opportunistic job."
    )
    utilization_window_s: float = Field(default=10.0, gt=0, description="Averaging window for utilisation.")
    queue_to_opportunistic_s: Optional[float] = Field(
        default=None, ge=0,
        description="A guaranteed job held over its tenant's quota this long is released as opportunistic "
                    "(upgraded once quota frees, with upgrade_running). Unset: it waits for quota. Slurm 22.05 keeps scheduling a "
                    "pending job by the GPU request it was submitted with, so the job still waits for a free "
                    "physical GPU; once running it is limited, throttled and preemptable like any "
                    "opportunistic job.")
    min_progress: float = Field(
        default=0.25, gt=0, le=1,
        description="Fraction of its solo rate an opportunistic job must be expected to make on a GPU for the GPU to "
                    "take it (predicted from the GPU's utilisation and jobs; none qualifies: see no_room), and "
                    "measured to make once running; under it the job is crawling. Beside a guaranteed job it crawls "
                    "under 1 / move_gain too, if that is higher (0.5 by default: a free GPU would still double its "
                    "pace; docs/evaluation.md, \"moves for pace, and narrowed elastic jobs\", 2026-11-26).")
    upgrade_running: bool = Field(
        default=False,
        description="true: a running opportunistic job whose tenant has quota again is made guaranteed in place "
                    "(no restart). Off by default: the quota it takes is then not there for the tenant's next "
                    "submissions, which job_submit.lua would admit guaranteed and start at once; on the Philly "
                    "window at saturated utilisation upgrades made the mean JCT 1.22x what it is without them, and "
                    "no better at production utilisation (docs/evaluation.md).")
    no_room: Literal["wait", "fallback"] = Field(
        default="wait",
        description="What the sidecar does when Slurm starts an opportunistic job on a node where fewer of its GPUs "
                    "meet the rules above than the job asked for (Slurm counted only slots; each node keeps one slot "
                    "so that submissions are accepted). wait: the Prolog requeues the job, which runs nowhere "
                    "meanwhile, and the coordinator keeps it off nodes without room. fallback: the job runs on the "
                    "least-loaded GPUs anyway, where it may crawl beside a busy guaranteed job (docs/evaluation.md: "
                    "this made mean JCT worse). With sidecar.enforce: false nothing is refused: fallback.")
    move_after_s: Optional[float] = Field(
        default=600.0, gt=0,
        description="Seconds a job may crawl before the coordinator moves it (notice, grace time, requeue, placed "
                    "away from the GPU it crawled on) to a GPU that promises move_gain times its progress. null: "
                    "never move.")
    move_gain: float = Field(
        default=2.0, ge=1,
        description="How many times its current progress a GPU must promise before a crawling job is moved there "
                    "(a move costs a checkpoint, a restart and the grace time). Its inverse is also the progress under "
                    "which a job beside a guaranteed job counts as crawling (see min_progress).")
    switch_wait_s: Optional[int] = Field(
        default=300, ge=0,
        description="job_submit.lua asks Slurm to put an opportunistic job under one leaf switch (sbatch "
                    "--switches=1@TIME, with a tree topology), waiting at most this many seconds before it starts "
                    "on more: a job spread over switches runs slower, and an opportunistic job has no deadline "
                    "to trade that for. A job's own --switches is kept, and a job that names several nodes (-w) "
                    "is asked nothing; a job on one node is always under one switch. Slurm caps the wait at "
                    "SchedulerParameters=max_switch_wait (300 s unless set). null: ask nothing.")


def _bind_address(v: str) -> str:
    import ipaddress

    try:
        ipaddress.ip_address(v)
    except ValueError:
        raise ValueError(f"{v!r} is not an IP address; use 127.0.0.1 (default), ::1, or the address "
                         "Prometheus scrapes") from None
    return v


class MetricsTls(_Strict):
    cert_file: str = Field(description="PEM certificate the metrics endpoint presents.")
    key_file: str = Field(description="Its PEM private key (readable by root only).")
    client_ca_file: str = Field(description="PEM CA(s) whose client certificates may scrape (Prometheus's "
                                            "tls_config cert_file/key_file); every other client is refused.")


class Sidecar(_Strict):
    socket_dir: str = Field(default="/run/slurm-antman", description="Per-node directory of IPC sockets.")
    telemetry: str = Field(default="auto", pattern=r"^(auto|nvml|emulated)$",
                           description="GPU telemetry: nvml, emulated, or auto (nvml when it works).")
    heartbeat_s: float = Field(default=1.0, gt=0)
    memory_headroom_mb: int = Field(default=512, ge=0, description="GPU memory kept free beside the guaranteed job.")
    min_opportunistic_memory_mb: int = Field(
        default=1024, ge=1, description="Below this an opportunistic job is preempted rather than shrunk.")
    target_slowdown: float = Field(default=0.02, gt=0, le=1,
                                   description="Slowdown of the guaranteed job the compute feedback aims under.")
    slow_preempt_s: Optional[float] = Field(
        default=None, gt=0,
        description="Seconds a guaranteed job may stay over target_slowdown while its GPU's opportunistic jobs are "
                    "already at the minimum compute share; then the newest of them is preempted (one per period). "
                    "null (default): only throttle. The requeued job is kept off that GPU (placement memory). In "
                    "simulation it kept busy guaranteed jobs closer to their target (1.016-1.020 of their work "
                    "against 1.022) and moved mean JCT no more than run-to-run noise (docs/evaluation.md, "
                    "\"Preemption for speed, now with placement memory\", 2026-11-27).")
    pause_max_s: Optional[float] = Field(
        default=120.0, gt=0,
        description="Pause in place before requeue: when a guaranteed job's burst leaves an opportunistic job less "
                    "than its minimum memory (or slow_preempt_s runs out), a job whose agents can pause moves its "
                    "GPU state to host memory and waits in place; paused this long, it is requeued after all. "
                    "null: never pause, requeue at once.")
    pin_budget_mb: Optional[int] = Field(
        default=None, ge=0,
        description="Host MiB per node opportunistic jobs may keep pinned for pauses (docs/architecture.md, \"The "
                    "sidecar and the agent\"): a first pause then skips zeroing fresh pages (3.1-10.8x the copies on "
                    "an H200, 2026-11-26). null: an eighth of nodes[].memory_mb; 0: none. Checked by `antman doctor`.")
    resume_hold_s: float = Field(
        default=10.0, ge=0,
        description="A paused job resumes once its GPU has had room for it again for this long, so that a burst "
                    "that comes and goes does not move its state back and forth.")
    elastic_hold_s: float = Field(
        default=300.0, ge=0,
        description="Elastic jobs (--antman-elastic=MIN:MAX, docs/elastic.md): the least time between two width "
                    "changes of one job, so a width pays for its restart before it changes again. A GPU a guaranteed "
                    "job claims is given up at once, whatever the hold.")
    enforce: bool = Field(
        default=True,
        description="false: observe only. The sidecar measures, places and reports as usual but gives every job "
                    "unlimited memory and a compute share of 1 and never asks for a preemption: opportunistic "
                    "jobs share GPUs uncontrolled (a staged rollout; the `shared` baseline of `antman bench trace`).")
    compliance_grace_s: float = Field(
        default=120.0, gt=0,
        description="An opportunistic job sharing a GPU with a guaranteed job is requeued once, for this long, it "
                    "has run without an agent (its processes on the GPU, NVML only), not acknowledged its limits, or "
                    "held more GPU memory than its limit (10 % and 256 MiB tolerated). Covers a job's start-up.")
    slot_filling: bool = Field(
        default=False,
        description="Idle-slot pages (docs/protocol.md, \"The idle-slot page\"): on a GPU shared by a "
                    "guaranteed job and opportunistic ones, the sidecar makes a shared-memory page in which the "
                    "guaranteed job's agent publishes when its GPU work is in flight and when it drained, readable "
                    "by that GPU's opportunistic jobs only, so that their agents launch into its idle slots. Needs "
                    "agents that name the \"slots\" feature and a socket_dir on a file system with POSIX ACLs "
                    "(else no page is offered). Off by default: on an H100 the gate filled 0.27 of the guaranteed job's "
                    "idle time and slowed it 2.4 % (docs/benchmarks.md, GPU proof run 4).")
    # policy.progress.FILL_EFFICIENCY: the config does not import the policy; a test keeps them equal.
    slot_fill_efficiency: float = Field(
        default=0.272, gt=0, le=1,
        description="With slot_filling: the fraction of a guaranteed job's idle GPU time its opportunistic "
                    "neighbours fill on this site's GPUs, which the placement predicts their progress by (beside "
                    "a guaranteed job at utilisation u an opportunistic job is promised this x (1 - u), and "
                    "waits where that is under opportunistic.min_progress). Default: an H100's, ResNet-50 at half "
                    "duty (docs/benchmarks.md, GPU proof run 4). Measure yours with `antman bench gpu --parts "
                    "slots` (its fill_efficiency); the devcluster's emulated GPU fills 0.69.")
    metrics_port: int = Field(default=0, ge=0, le=65535,
                              description="Prometheus endpoint port of the sidecar; 0 turns it off. With several "
                                          "slurmd on one host, only one sidecar can bind it.")
    metrics_bind: str = Field(default="127.0.0.1", description="Address the sidecar's metrics endpoint binds.")
    metrics_tls: Optional[MetricsTls] = Field(
        default=None, description="HTTPS with client certificates for the metrics endpoint, which shows every job's "
                                  "account, memory and mini-batch time: set it whenever metrics_bind is reachable by "
                                  "users (anything but 127.0.0.1 on a node they cannot log in to).")

    _bind = field_validator("metrics_bind")(classmethod(lambda cls, v: _bind_address(v)))


QUERY_PORT_OFFSET = 3


def _zmq_endpoint(v: str) -> str:
    # Only transports that CURVE can protect and that a sidecar can reach.
    if not re.match(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}|ipc:///\S+)$", v):
        raise ValueError(f"{v!r} is not a ZeroMQ endpoint; allowed: tcp://HOST:PORT or ipc:///PATH")
    return v


class Coordinator(_Strict):
    endpoint: str = Field(default="tcp://127.0.0.1:17900", description="Where sidecars report.")
    key_dir: Optional[str] = Field(
        default=None,
        description="ZeroMQ CURVE keys made by `antman keys init`: coordinator.key(_secret), sidecars/NODE.key (the "
                    "public keys allowed to connect), nodes/NODE.key_secret. Unset: sidecars run without an uplink.")
    node_secret_key: Optional[str] = Field(
        default=None,
        description="Where a sidecar finds its secret key; '{node}' is replaced by the node name. "
                    "Default: KEY_DIR/nodes/{node}.key_secret.")
    report_interval_s: float = Field(default=2.0, gt=0, le=3600,
                                     description="Seconds between a sidecar's reports to the coordinator.")
    query_endpoint: Optional[str] = Field(
        default=None,
        description="Where the `antman` CLI of any user on any host asks the coordinator for live job numbers "
                    "(`antman squeue`, `antman nodes`) and job stories (`antman explain`); requests carry a munge "
                    "credential and each user sees the details of their own jobs only. null: the host of "
                    "`endpoint` at its port + 3 (ipc: its path + '.query'); 'off': not served.")
    admin_users: list[str] = Field(
        default_factory=list,
        description="Users who see every job's details through the query endpoint, as root does.")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        return _zmq_endpoint(v)

    @field_validator("node_secret_key")
    @classmethod
    def _template(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and "{node}" not in v and not v.endswith(".key_secret"):
            raise ValueError(f"{v!r} must contain '{{node}}' (one key per node) or name a .key_secret file")
        return v

    @field_validator("query_endpoint")
    @classmethod
    def _query_endpoint(cls, v: Optional[str]) -> Optional[str]:
        if v is None or v == "off":
            return v
        return _zmq_endpoint(v)

    @model_validator(mode="after")
    def _query_differs(self) -> "Coordinator":
        q = self.query_address()
        if q is not None and q == self.endpoint:
            raise ValueError(f"query_endpoint {q!r} is the sidecars' endpoint; give it a port of its own")
        return self

    def query_address(self) -> Optional[str]:
        """The query endpoint in force, or None when it is off. The default skips the uplink port's next
        two: the devcluster puts its MariaDB and slurmdbd there."""
        if self.query_endpoint == "off":
            return None
        if self.query_endpoint is not None:
            return self.query_endpoint
        if self.endpoint.startswith("ipc://"):
            return self.endpoint + ".query"
        host, _, port = self.endpoint.rpartition(":")
        if int(port) + QUERY_PORT_OFFSET > 65535:
            raise ValueError(f"endpoint {self.endpoint!r}: port {port} leaves no room for the default "
                             "query_endpoint (port + 3); set coordinator.query_endpoint")
        return f"{host}:{int(port) + QUERY_PORT_OFFSET}"

    def secret_key_path(self, node: str) -> Optional[str]:
        """The node sidecar's CURVE secret key file, or None when no keys are configured."""
        if self.node_secret_key is not None:
            return self.node_secret_key.replace("{node}", node)
        if self.key_dir is None:
            return None
        return str(Path(self.key_dir) / "nodes" / f"{node}.key_secret")
    audit_log: str = Field(default="/var/log/slurm-antman/coordinator-audit.jsonl",
                           description="Append-only JSON-lines record of every coordinator decision.")
    audit_max_bytes: int = Field(
        default=64 << 20, ge=0,
        description="Size at which the audit log is rotated: renamed AUDIT_LOG.1 (older ones shift to .2, ...) "
                    "at the end of a decision cycle, and a new file begun with the coordinator's state. "
                    "0: never (for logrotate, which must rename the file and send SIGHUP; never copytruncate).")
    audit_keep: int = Field(default=5, ge=1, le=1000,
                            description="Rotated audit log files kept (AUDIT_LOG.1 to .N); `antman explain` "
                                        "reads them all, oldest first.")
    cycle_s: float = Field(default=1.0, gt=0, le=60, description="Seconds between decision cycles.")
    quota_file: Optional[str] = Field(
        default=None, description="antman_quota.lua next to job_submit.lua: tenant quota use, rewritten by "
                                  "the coordinator every cycle so job_submit.lua resolves auto at submission.")
    quota_source: Literal["auto", "accounting", "antman_yaml"] = Field(
        default="auto", description="Where tenant quotas come from. auto: Slurm accounting (each account's "
        "GrpTRES=gres/gpu=N, read with sacctmgr) when slurmctld runs with AccountingStorageType="
        "accounting_storage/slurmdbd, else antman.yaml tenants; accounting: Slurm accounting only (an error "
        "while Slurm has none); antman_yaml: antman.yaml tenants even where accounting exists (an override).")
    accounting_refresh_s: float = Field(default=60.0, gt=0, le=86400,
                                        description="Seconds between reads of the quotas in Slurm accounting.")
    stale_report_s: float = Field(default=30.0, gt=0,
                                  description="A sidecar report older than this counts as no report.")
    metrics_port: int = Field(default=0, ge=0, le=65535,
                              description="Prometheus endpoint port of the coordinator; 0 turns it off.")
    metrics_bind: str = Field(default="127.0.0.1", description="Address the coordinator's metrics endpoint binds.")
    metrics_tls: Optional[MetricsTls] = Field(
        default=None, description="HTTPS with client certificates for the coordinator's metrics endpoint (as "
                                  "sidecar.metrics_tls).")

    _bind = field_validator("metrics_bind")(classmethod(lambda cls, v: _bind_address(v)))


class AntmanConfig(_Strict):
    cluster_name: str = Field(default="antman", pattern=_SLURM_NAME)
    # Not strict: YAML has no enums, so the value arrives as text; only the listed names are accepted.
    default_class: DefaultClass = Field(default=DefaultClass.none, strict=False)
    grace_time_s: int = Field(default=30, ge=0, le=3600, description="Seconds between notice and requeue.")
    state_dir: str = Field(default="/var/lib/slurm-antman", description="Node-local state (GPU choices).")
    plugin_path: str = Field(
        default="/usr/lib/x86_64-linux-gnu/slurm-wlm/antman_spank.so",
        description="Installed SPANK plugin, as plugstack.conf should name it.",
    )
    antman_command: str = Field(default="/usr/local/bin/antman", description="The antman CLI on nodes.")
    agent_path: Optional[str] = Field(
        default="/opt/slurm-antman/agent", pattern=r"^/\S*$",
        description="The agent bundle on every node (`antman agent-bundle`, made by `make install`): the SPANK "
                    "plugin puts it first on a managed job's PYTHONPATH, so a job's own Python (a venv with "
                    "only torch, conda, a container that mounts it) gets the agent. null: only Pythons with "
                    "slurm-antman installed get it.",
    )
    slurm: SlurmNames = SlurmNames()
    opportunistic: Opportunistic = Opportunistic()
    sidecar: Sidecar = Sidecar()
    coordinator: Coordinator = Coordinator()
    nodes: list[NodeGroup] = Field(min_length=1)
    tenants: list[Tenant] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> "AntmanConfig":
        seen: set[str] = set()
        for g in self.nodes:
            for h in g.hosts:
                if h in seen:
                    raise ValueError(f"node {h!r} appears in more than one nodes entry")
                seen.add(h)
        accounts = [t.account for t in self.tenants]
        dup = {a for a in accounts if accounts.count(a) > 1}
        if dup:
            raise ValueError(f"tenant account(s) listed twice: {', '.join(sorted(dup))}")
        return self

    def node_groups_by_host(self) -> dict[str, NodeGroup]:
        return {h: g for g in self.nodes for h in g.hosts}

    def pin_budget_bytes(self, node: str) -> int:
        """sidecar.pin_budget_mb for ``node``, its default an eighth of the node's memory_mb."""
        group = self.node_groups_by_host().get(node)
        mb = self.sidecar.pin_budget_mb if self.sidecar.pin_budget_mb is not None else (group.memory_mb // 8 if group else 0)
        return mb << 20

    def node_socket_dir(self, node: str) -> str:
        """Sockets of one node's sidecar. Per node name, so several slurmd on one host do not collide."""
        return f"{self.sidecar.socket_dir.rstrip('/')}/{node}"
