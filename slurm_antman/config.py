"""The site configuration, ``antman.yaml``: one pydantic model that every component reads.

Validation errors name the field (as a dotted path into the YAML) and what is allowed, because
the person reading them is an admin editing a file, not a Python developer.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import hostlist
from .errors import AntmanError

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
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class SlurmNames(_Strict):
    gpu_gres: str = Field(default="gpu", pattern=_SLURM_NAME, description="GRES name of physical GPUs.")
    opportunistic_gres: str = Field(
        default="antman_opp", pattern=_SLURM_NAME,
        description="Count-only GRES that stands for opportunistic GPU slots.",
    )
    guaranteed_partition: str = Field(default="gpu", pattern=_SLURM_NAME)
    opportunistic_partition: str = Field(default="opportunistic", pattern=_SLURM_NAME)
    opportunistic_qos: Optional[str] = Field(
        default=None, description="QOS given to opportunistic jobs; none keeps the job's own."
    )
    default_partition: str = Field(
        default="gpu", pattern=_SLURM_NAME, description="Partition marked Default=YES."
    )

    @model_validator(mode="after")
    def _distinct(self) -> "SlurmNames":
        if self.gpu_gres == self.opportunistic_gres:
            raise ValueError("gpu_gres and opportunistic_gres must differ")
        if self.guaranteed_partition == self.opportunistic_partition:
            raise ValueError("guaranteed_partition and opportunistic_partition must differ")
        return self


class Opportunistic(_Strict):
    slots_per_gpu: int = Field(default=2, ge=1, le=16, description="Opportunistic jobs one GPU may host.")
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
                    "measured to make once running; under it the job is crawling.")
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
                    "(a move costs a checkpoint, a restart and the grace time).")


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
                    "null (default): only throttle. Slurm may place the requeued job back on the same GPU, so "
                    "enable it where nodes have GPUs to spare (docs/evaluation.md measures both).")
    pause_max_s: Optional[float] = Field(
        default=120.0, gt=0,
        description="Pause in place before requeue: when a guaranteed job's burst leaves an opportunistic job less "
                    "than its minimum memory (or slow_preempt_s runs out), a job whose agents can pause moves its "
                    "GPU state to host memory and waits in place; paused this long, it is requeued after all. "
                    "null: never pause, requeue at once (as before issue 16).")
    resume_hold_s: float = Field(
        default=10.0, ge=0,
        description="A paused job resumes once its GPU has had room for it again for this long, so that a burst "
                    "that comes and goes does not move its state back and forth.")
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
        description="ZeroMQ CURVE keys made by `antman keys init`: coordinator.key(_secret), "
                    "sidecars/NODE.key (the public keys allowed to connect), nodes/NODE.key_secret. "
                    "Unset: sidecars run without an uplink.")
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
    default_class: DefaultClass = DefaultClass.none
    grace_time_s: int = Field(default=30, ge=0, le=3600, description="Seconds between notice and requeue.")
    state_dir: str = Field(default="/var/lib/slurm-antman", description="Node-local state (GPU choices).")
    plugin_path: str = Field(
        default="/usr/lib/x86_64-linux-gnu/slurm-wlm/antman_spank.so",
        description="Installed SPANK plugin, as plugstack.conf should name it.",
    )
    antman_command: str = Field(default="/usr/local/bin/antman", description="The antman CLI on nodes.")
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

    def node_socket_dir(self, node: str) -> str:
        """Sockets of one node's sidecar. Per node name, so several slurmd on one host do not collide."""
        return f"{self.sidecar.socket_dir.rstrip('/')}/{node}"


class ConfigError(AntmanError):
    """A config file that cannot be used; ``problems`` lists ``(field path, message)``."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {path}: {msg}" for path, msg in problems)
        super().__init__(f"{source}: invalid configuration\n{lines}")


def _describe(err: dict) -> tuple[str, str]:
    path = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field (check the spelling; see docs/admin.md for the fields)"
    elif err["type"] == "enum":
        msg = f"{err.get('input')!r} is not allowed; allowed: {err['ctx']['expected']}"
    elif err["type"] == "string_pattern_mismatch" and path.endswith("telemetry"):
        msg = f"{err.get('input')!r} is not allowed; allowed: 'auto', 'nvml', 'emulated'"
    return path, msg


def parse(data: object, source: str = "<config>") -> AntmanConfig:
    if not isinstance(data, dict):
        raise ConfigError(source, [("(top level)", "expected a mapping of fields")])
    try:
        return AntmanConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, [_describe(err) for err in e.errors()]) from None


# A real antman.yaml is a few kB; its size and shape are bounded before anything walks it (an alias
# bomb is small on disk and huge once expanded; deep nesting exhausts the recursion).
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NODES = 100_000


def _expanded_size(node: yaml.Node, budget: int) -> int:
    """YAML nodes ``node`` stands for once every alias is expanded, counting no further than ``budget``."""
    seen, stack = 0, [node]
    while stack:
        n = stack.pop()
        seen += 1
        if seen > budget:
            return seen
        if isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
        elif isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack.extend((k, v))
    return seen


def load(path: str | Path) -> AntmanConfig:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(str(path), [("(file)", e.strerror or str(e))]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(str(path), [("(file)", f"larger than {MAX_CONFIG_BYTES} bytes; not an antman.yaml")])
    try:
        text = raw.decode()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None and _expanded_size(node, MAX_CONFIG_NODES) > MAX_CONFIG_NODES:
            raise ConfigError(str(path), [("(file)", f"more than {MAX_CONFIG_NODES} values once its aliases are "
                                                     "expanded; not an antman.yaml (an alias bomb?)")])
        data = yaml.safe_load(text)
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), [("(file)", f"not UTF-8 text: {e.reason} at byte {e.start}")]) from None
    except RecursionError:
        raise ConfigError(str(path), [("(file)", "nested too deeply; not an antman.yaml")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        raise ConfigError(str(path), [(where, f"not valid YAML: {getattr(e, 'problem', e)}")]) from None
    try:
        return parse(data, str(path))
    except RecursionError:
        raise ConfigError(str(path), [("(file)", "nested too deeply; not an antman.yaml")]) from None
