"""The coordinator's query channel: any user's `antman` CLI, on any host, asks for the live numbers the
sidecars report and for a job's audit-log story; each caller sees the details of their own jobs only.

Who asks is munge's word, never the message's: a request carries a munge credential whose payload is
the request itself (``protocol.query_payload``); munged decodes it to the uid and gid of the process that
made it, refuses one it has decoded before, and one past its time-to-live. The caller's user name is
looked up on this host (which shares its users with every host of the cluster, as Slurm requires),
and a job's owner is the user Slurm names for it in the coordinator's latest snapshot, or in the job's
audit records. root and ``coordinator.admin_users`` see everything. Job ids, classes, GPUs and the
GPUs' own telemetry are everyone's, as squeue and ``scontrol show node`` are; a job's memory use and
limit, compute share, iteration time, pause state and story are its owner's and the admins'.

The server runs in a thread of its own with its own socket. Decoding a credential is a round trip to
munged, and explain reads the audit log and may ask Slurm whose a forgotten job was; none of it may
hold up a decision cycle. The daemon's loop hands it an immutable :class:`QueryView` after every
change (``publish``), so the thread never reads the loop's own dicts while they change.
"""

from __future__ import annotations

import json
import logging
import pwd
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import zmq

from slurm_antman import munge
from slurm_antman import protocol as p
from slurm_antman.errors import AntmanError
from slurm_antman.ratelimit import RateLimitedLog

from . import audit
from .explain import records_for

log = logging.getLogger("antman.coordinator.query")

# A request is a credential and a few fields: anything much larger is not one. libzmq drops the
# connection of a peer that sends more, before the message reaches this code.
MAX_REQUEST_BYTES = 64 * 1024
# A reply's items fill a page up to this many bytes of JSON; the envelope and caller fit in the rest
# of protocol.MAX_MESSAGE_BYTES.
PAGE_BYTES = 768 * 1024
# Token buckets: (requests per second, burst). Per network address before the credential is decoded
# (a login node's users share one), per uid after it.
PEER_RATE = (50.0, 200.0)
UID_RATE = (10.0, 40.0)
USER_NAME_TTL_S = 300.0


class QueryServerError(AntmanError):
    pass


@dataclass(frozen=True)
class QueryView:
    """What the daemon's loop publishes for the query thread; never changed once published."""

    reports: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # node -> hub.HeardReport
    owners: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))   # job id -> Slurm user
    admin_users: frozenset = frozenset()
    stale_report_s: float = 30.0


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    user: Optional[str]  # None: the uid has no name on this host, so it owns no job here
    admin: bool

    def may_see(self, owner: Optional[str]) -> bool:
        return self.admin or (self.user is not None and owner is not None and owner == self.user)

    def wire(self) -> p.QueryCaller:
        return p.QueryCaller(uid=self.uid, user=self.user, admin=self.admin)


class _UserNames:
    """uid -> user name on this host, cached: with LDAP or sssd behind NSS a lookup can take a while."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cache: dict[int, tuple[float, Optional[str]]] = {}

    def __call__(self, uid: int) -> Optional[str]:
        now = self._clock()
        hit = self._cache.get(uid)
        if hit is not None and now - hit[0] < USER_NAME_TTL_S:
            return hit[1]
        try:
            name: Optional[str] = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = None
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[uid] = (now, name)
        return name


def caller_for(uid: int, gid: int, admin_users: frozenset, user_name: Callable[[int], Optional[str]]) -> Caller:
    user = user_name(uid)
    return Caller(uid=uid, gid=gid, user=user, admin=uid == 0 or (user is not None and user in admin_users))


class _Buckets:
    """Token buckets by key, bounded: idle keys (full buckets) are dropped when there are too many."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 10_000):
        self.rate, self.burst, self._clock, self._max = rate, burst, clock, max_keys
        self._b: dict[str, tuple[float, float]] = {}

    def take(self, key: str) -> bool:
        now = self._clock()
        tokens, last = self._b.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        self._b[key] = (tokens - 1.0 if ok else tokens, now)
        if len(self._b) > self._max:
            self._b = {k: v for k, v in self._b.items()
                       if v[0] + (now - v[1]) * self.rate < self.burst}
        return ok


# --- what a caller sees (pure: view and caller in, protocol objects out) ----------------------------

def _fresh(view: QueryView, now: float) -> list[tuple[str, Any]]:
    """The reports the coordinator itself would act on: a sidecar silent for longer is gone."""
    return sorted((n, r) for n, r in view.reports.items() if now - r.received_unix <= view.stale_report_s)


def _job(rj: p.ReportJob, node: str, visible: bool) -> p.QueryJob:
    if not visible:
        return p.QueryJob(job_id=rj.job_id, node=node, job_class=rj.job_class, gpus=list(rj.gpus), visible=False,
                          mem_limit_bytes=None, mem_used_bytes=None, compute_share=None, iteration_ms=None,
                          paused=None)
    return p.QueryJob(job_id=rj.job_id, node=node, job_class=rj.job_class, gpus=list(rj.gpus), visible=True,
                      mem_limit_bytes=rj.mem_limit_bytes, mem_used_bytes=rj.mem_used_bytes,
                      compute_share=rj.compute_share, iteration_ms=rj.iteration_ms, paused=rj.paused)


def job_rows(view: QueryView, caller: Caller, now: float) -> list[p.QueryJob]:
    """One row per job and node the sidecars report, details only where ``caller`` may see them."""
    return [_job(rj, node, caller.may_see(view.owners.get(rj.job_id)))
            for node, rep in _fresh(view, now) for rj in rep.jobs]


def node_rows(view: QueryView, caller: Caller, now: float) -> list[p.QueryNode]:
    out = []
    for node, rep in _fresh(view, now):
        gpus = [p.QueryGpu(index=g.index, memory_used_bytes=g.mem_used_bytes, memory_total_bytes=g.mem_total_bytes,
                           utilization=g.util, util_measured=g.util_measured, jobs=list(g.jobs)) for g in rep.gpus]
        jobs = [_job(rj, node, caller.may_see(view.owners.get(rj.job_id))) for rj in rep.jobs]
        out.append(p.QueryNode(node=node, telemetry=rep.telemetry, report_unix=rep.received_unix,
                               unhealthy=rep.unhealthy, gpus=gpus, jobs=jobs))
    return out


def _size(item: Any) -> int:
    return len(json.dumps(item if isinstance(item, dict) else p.body_dict(item), separators=(",", ":"))) + 1


def paginate(items: list, budget: int = PAGE_BYTES) -> list[list]:
    """``items`` cut into pages of at most ``budget`` bytes of JSON each (an item larger than that gets
    a page of its own); always at least one page. Deterministic for one list, so a client that asks
    page after page of an unchanged view gets each item once."""
    pages: list[list] = [[]]
    used = 0
    for it in items:
        n = _size(it)
        if pages[-1] and used + n > budget:
            pages.append([])
            used = 0
        pages[-1].append(it)
        used += n
    return pages


def audit_records(path: str, job_id: str) -> list[dict]:
    """The job's records in the audit log at ``path`` and its rotated files (oldest first), as ``antman
    explain`` shows them. Lines are matched as text before they are parsed: a log of a year holds many
    jobs, and this runs per request."""
    needle = f'"job_id":"{job_id}"'
    recs = []
    for line in audit.lines(path):
        if needle not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(rec, dict) and "kind" in rec:
            recs.append(rec)
    return records_for(job_id, recs)


def newest_that_fit(records: list[dict], budget: int = PAGE_BYTES) -> tuple[list[dict], int]:
    """The newest records whose JSON fits ``budget``, oldest first, and how many older ones were left out."""
    kept: list[dict] = []
    used = 0
    for rec in reversed(records):
        n = _size(rec)
        if used + n > budget:
            break
        kept.append(rec)
        used += n
    kept.reverse()
    return kept, len(records) - len(kept)


# --- one request in, one reply out ----------------------------------------------------------------

_CREDENTIAL_CODES = (
    (munge.CredentialReplayed, p.ErrorCode.replayed_credential),
    (munge.CredentialExpired, p.ErrorCode.expired_credential),
    (munge.CredentialError, p.ErrorCode.bad_credential),
)


class QueryHandler:
    """Everything of the query channel but the socket, so it can be driven frame by frame.

    ``view``: the latest published :class:`QueryView`; ``decode``: a munge credential to its
    :class:`munge.Credential` (munged's word); ``owner_lookup``: Slurm's word on whose a job is, for
    jobs neither the view nor the audit log names (records written before they named users)."""

    def __init__(self, view: Callable[[], QueryView], audit_path: str,
                 decode: Callable[[str], munge.Credential] = munge.decode,
                 owner_lookup: Optional[Callable[[str], Optional[str]]] = None,
                 user_name: Optional[Callable[[int], Optional[str]]] = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 page_bytes: int = PAGE_BYTES):
        self.view = view
        self.audit_path = audit_path
        self.decode = decode
        self.owner_lookup = owner_lookup
        self.user_name = user_name or _UserNames(monotonic)
        self.clock = clock
        self.page_bytes = page_bytes
        self._peers = _Buckets(*PEER_RATE, clock=monotonic)
        self._uids = _Buckets(*UID_RATE, clock=monotonic)
        self._rlog = RateLimitedLog(log)

    def handle(self, frames: list, peer: str = "") -> p.Message:
        """The reply to one request (routing identity already stripped); never raises."""
        ref = None
        try:
            if not self._peers.take(peer):
                self._rlog.warning(f"rate:{peer}", "query: %s asks too often; refused", peer or "a peer")
                return p.error_message(p.ErrorCode.rate_limited, "too many requests from this address; "
                                       "try again in a second")
            if sum(len(getattr(f, "bytes", f)) for f in frames) > MAX_REQUEST_BYTES:
                return p.error_message(p.ErrorCode.too_large, f"a query request is at most {MAX_REQUEST_BYTES} bytes")
            try:
                msg = p.decode(frames, p.QUERY_REQUESTS)
            except p.ProtocolError as e:
                self._rlog.warning(f"bad:{peer}:{e.code.value}", "query: bad request from %s (%s): %s",
                                   peer or "?", e.code.value, e.message)
                return p.error_message(e.code, e.message, e.ref)
            ref = msg.id
            body = msg.body
            if isinstance(body, p.Heartbeat):
                return p.reply(msg, p.Heartbeat())  # reachability only: it tells nothing about anyone
            refused = self._authenticate(msg)
            if isinstance(refused, p.Message):
                return refused
            cred = refused
            if not self._uids.take(f"uid:{cred.uid}"):
                self._rlog.warning(f"rate:uid:{cred.uid}", "query: uid %d asks too often; refused", cred.uid)
                return p.error_message(p.ErrorCode.rate_limited, "too many requests from this user; "
                                       "try again in a second", ref)
            view = self.view()
            caller = caller_for(cred.uid, cred.gid, view.admin_users, self.user_name)
            if isinstance(body, p.QueryJobs):
                return self._paged(msg, view, caller, job_rows(view, caller, self.clock()), p.QueryJobsReply, "jobs")
            if isinstance(body, p.QueryNodes):
                return self._paged(msg, view, caller, node_rows(view, caller, self.clock()), p.QueryNodesReply, "nodes")
            if isinstance(body, p.QueryExplain):
                return self._explain(msg, body, view, caller)
            return p.error_message(p.ErrorCode.wrong_direction, f"{msg.type!r} is not a query", ref)
        except Exception as e:  # noqa: BLE001 - a bug answers one request with an error, never ends the server
            log.exception("query: internal error")
            return p.error_message(p.ErrorCode.internal, f"the coordinator failed on this request: {e}", ref)

    def _authenticate(self, msg: p.Message) -> Any:
        """munged's Credential for ``msg``, or the error reply that refuses it."""
        body = msg.body
        try:
            cred = self.decode(body.credential)
        except munge.MungeUnavailable as e:
            self._rlog.warning("munge-down", "query: cannot check credentials: %s", e)
            return p.error_message(p.ErrorCode.internal, f"the coordinator cannot check munge credentials: {e}",
                                   msg.id)
        except munge.MungeError as e:
            code = next((c for cls, c in _CREDENTIAL_CODES if isinstance(e, cls)), p.ErrorCode.internal)
            return p.error_message(code, f"credential refused: {e}", msg.id)
        if cred.payload != p.query_payload(msg.id, body):
            return p.error_message(p.ErrorCode.bad_credential, "credential refused: it was made for another "
                                   "request (its payload must be this request's query_payload)", msg.id)
        return cred

    def _paged(self, msg: p.Message, view: QueryView, caller: Caller, items: list, reply_cls: type,
               name: str) -> p.Message:
        pages = paginate(items, self.page_bytes)
        page = msg.body.page
        if page >= len(pages):
            return p.error_message(p.ErrorCode.bad_value, f"{msg.type}.page: {page} is past the last page "
                                   f"({len(pages) - 1})", msg.id)
        return p.reply(msg, reply_cls(caller=caller.wire(), page=page, pages=len(pages), **{name: pages[page]}))

    def _explain(self, msg: p.Message, body: p.QueryExplain, view: QueryView, caller: Caller) -> p.Message:
        recs = audit_records(self.audit_path, body.job_id)
        owner = view.owners.get(body.job_id) or next((r["user"] for r in recs if isinstance(r.get("user"), str)), None)
        if owner is None and recs and not caller.admin and self.owner_lookup is not None:
            owner = self.owner_lookup(body.job_id)
        if not caller.may_see(owner) and (recs or owner is not None):
            why = "only its owner and admins see its story"
            return p.error_message(p.ErrorCode.forbidden, f"job {body.job_id} is not yours: {why}"
                                   if owner is not None else f"cannot tell whose job {body.job_id} is: {why}", msg.id)
        kept, omitted = newest_that_fit(recs, self.page_bytes)
        return p.reply(msg, p.QueryExplainReply(caller=caller.wire(), job_id=body.job_id, owner=owner,
                                                records=kept, omitted=omitted))


def slurm_owner(backend: Any, monotonic: Callable[[], float] = time.monotonic,
                retry_s: float = 60.0) -> Callable[[str], Optional[str]]:
    """Slurm's word on whose a job is: slurmctld while it remembers the job, then accounting. Each
    answer is kept (a job's user never changes), and a job Slurm could not place is not asked about
    again for ``retry_s``: a user asking about many old jobs costs Slurm one call per job."""
    from slurm_antman.slurm import SlurmError

    known: dict[str, str] = {}
    unknown: dict[str, float] = {}

    def lookup(job_id: str) -> Optional[str]:
        if job_id in known:
            return known[job_id]
        if monotonic() - unknown.get(job_id, -retry_s) < retry_s:
            return None
        try:
            user = backend.job_user(int(job_id))
        except (SlurmError, ValueError):
            user = None
        for memo in (known, unknown):
            if len(memo) > 10_000:
                memo.clear()
        if user:
            known[job_id] = user
        else:
            unknown[job_id] = monotonic()
        return user
    return lookup


# --- the socket ------------------------------------------------------------------------------------

class QueryServer:
    """A ROUTER at ``endpoint`` served by a thread of its own. ``publish`` is the daemon loop's only call
    while it runs (an attribute swap); ``start`` and ``stop`` belong to the daemon's thread."""

    def __init__(self, endpoint: str, handler_factory: Callable[[Callable[[], QueryView]], QueryHandler]):
        self.endpoint = endpoint
        self._view = QueryView()
        self.handler = handler_factory(lambda: self._view)
        self._ctx: Optional[zmq.Context] = None
        self._sock: Optional[zmq.Socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.served = 0

    def publish(self, view: QueryView) -> None:
        self._view = view

    def start(self) -> None:
        self._ctx = zmq.Context()
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        s.setsockopt(zmq.RCVHWM, 1000)
        s.setsockopt(zmq.SNDHWM, 1000)
        try:
            s.bind(self.endpoint)
        except zmq.ZMQError as e:
            s.close(0)
            self._ctx.term()
            self._ctx = None
            raise QueryServerError(f"cannot bind the query endpoint {self.endpoint}: {e}") from None
        self.endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, when bound to tcp://HOST:*
        self._sock = s  # handed to the thread below; the daemon's thread never touches it again
        self._thread = threading.Thread(target=self._serve, name="antman-query", daemon=True)
        self._thread.start()
        log.info("query endpoint on %s (munge-authenticated)", self.endpoint)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._one(sock, frames)
        finally:
            sock.close(0)

    def _one(self, sock: zmq.Socket, frames: list) -> None:
        if len(frames) < 2:
            return  # nothing to answer to
        identity = frames[0].bytes
        try:
            peer = frames[-1].get("Peer-Address") or ""
        except zmq.ZMQError:
            peer = ""
        reply = self.handler.handle([f.bytes for f in frames[1:]], peer or identity.hex())
        try:
            out = p.encode(reply)
        except p.ProtocolError as e:
            log.error("query: cannot encode the reply to a %s request: %s", reply.type, e)
            out = p.encode(p.error_message(p.ErrorCode.internal, f"the reply could not be encoded: {e}", reply.ref))
        try:
            sock.send_multipart([identity, *out], zmq.NOBLOCK)
            self.served += 1
        except zmq.ZMQError:
            pass  # the client is gone or not reading: its reply is dropped, as it would time out anyway
