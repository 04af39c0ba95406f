"""The coordinator's query channel (docs/protocol.md, "Query channel"), with a real munged and real ZeroMQ
sockets and no Slurm: who sees what, the messages, and the requests it refuses (and survives)."""

from __future__ import annotations

import json
import random
import time
from types import MappingProxyType

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_antman import munge
from slurm_antman import protocol as p
from slurm_antman.coordinator import query as q
from slurm_antman.clients import coordinator_query as qc
from slurm_antman.coordinator.hub import HeardReport
from test_munge import DEV_USER, as_user_python, dev_user, munged  # noqa: F401 - fixtures

GiB = 1 << 30


def _rjob(job_id: str, mem: int, gpus=(0,), paused: bool = False) -> p.ReportJob:
    return p.ReportJob(job_id=job_id, job_class="opportunistic", gpus=list(gpus), mem_limit_bytes=4 * GiB,
                       mem_used_bytes=mem, compute_share=0.5, iteration_ms=51.5, last_checkpoint_unix=None,
                       paused=paused)


def _report(node: str, jobs: list[p.ReportJob], at: float) -> HeardReport:
    gpu_jobs: dict[int, list[str]] = {}
    for j in jobs:
        for g in j.gpus:
            gpu_jobs.setdefault(g, []).append(j.job_id)
    gpus = [p.ReportGpu(index=i, mem_total_bytes=16 * GiB, mem_used_bytes=3 * GiB, util=0.25, jobs=gpu_jobs.get(i, []))
            for i in range(2)]
    body = p.NodeReport(node=node, telemetry="emulated", gpus=gpus, jobs=jobs, preempt_requests=[])
    return HeardReport(node, at, body)


def view(now: float | None = None, admins: frozenset = frozenset()) -> q.QueryView:
    """Jobs of two users: root's 7 and antman-dev's 8 share n1's GPU 0; antman-dev's 9 spans n2's GPUs;
    10 is reported but not in a snapshot yet (no owner known); n3's sidecar went silent."""
    now = time.time() if now is None else now
    reports = {
        "n1": _report("n1", [_rjob("7", 1 * GiB), _rjob("8", 2 * GiB, paused=True)], now - 1),
        "n2": _report("n2", [_rjob("9", 3 * GiB, gpus=(0, 1)), _rjob("10", 5 * GiB, gpus=(1,))], now - 1),
        "n3": _report("n3", [_rjob("11", 1 * GiB)], now - 300),
    }
    return q.QueryView(reports=MappingProxyType(reports),
                       owners=MappingProxyType({"7": "root", "8": DEV_USER, "9": DEV_USER, "11": DEV_USER}),
                       admin_users=admins, stale_report_s=30.0)


def _names(uid: int):
    return {0: "root", 1001: DEV_USER, 1002: "operator"}.get(uid)


DETAILS = ("mem_limit_bytes", "mem_used_bytes", "compute_share", "iteration_ms", "paused")


# --- the filter --------------------------------------------------------------------------------------

def test_root_sees_every_job_in_detail_and_stale_nodes_not_at_all():
    root = q.caller_for(0, 0, frozenset(), _names)
    assert root.admin and root.user == "root"
    rows = {(r.job_id, r.node): r for r in q.job_rows(view(), root, time.time())}
    assert set(rows) == {("7", "n1"), ("8", "n1"), ("9", "n2"), ("10", "n2")}  # n3's report is stale
    assert all(r.visible for r in rows.values())
    assert rows[("8", "n1")].mem_used_bytes == 2 * GiB and rows[("8", "n1")].paused is True
    assert rows[("9", "n2")].gpus == [0, 1]


def test_a_user_sees_every_job_but_the_details_of_their_own_only():
    dev = q.caller_for(1001, 1001, frozenset(), _names)
    assert not dev.admin and dev.user == DEV_USER
    rows = {r.job_id: r for r in q.job_rows(view(), dev, time.time())}
    assert set(rows) == {"7", "8", "9", "10"}
    for own in ("8", "9"):
        assert rows[own].visible and rows[own].mem_used_bytes is not None and rows[own].iteration_ms == 51.5
    for other in ("7", "10"):  # root's, and one whose owner the coordinator does not know yet
        r = rows[other]
        assert not r.visible and all(getattr(r, k) is None for k in DETAILS)
        assert (r.job_class, r.gpus) == ("opportunistic", [0] if other == "7" else [1])  # Slurm shows those
    # The nodes: GPU telemetry and which jobs are on each GPU are everyone's.
    nodes = {n.node: n for n in q.node_rows(view(), dev, time.time())}
    assert set(nodes) == {"n1", "n2"}
    assert nodes["n1"].gpus[0].jobs == ["7", "8"] and nodes["n1"].gpus[0].memory_used_bytes == 3 * GiB
    jobs = {j.job_id: j for j in nodes["n1"].jobs}
    assert jobs["8"].visible and jobs["8"].mem_used_bytes == 2 * GiB
    assert not jobs["7"].visible and jobs["7"].mem_used_bytes is None


def test_admin_users_see_all_and_an_unnamed_uid_sees_no_details():
    op = q.caller_for(1002, 1002, frozenset({"operator"}), _names)
    assert op.admin and all(r.visible for r in q.job_rows(view(), op, time.time()))
    nobody = q.caller_for(4242, 4242, frozenset({"operator"}), _names)
    assert nobody.user is None and not nobody.admin
    assert not any(r.visible for r in q.job_rows(view(), nobody, time.time()))


def test_paginate_keeps_every_item_once_within_the_budget():
    items = [{"n": i, "pad": "x" * random.randint(0, 50)} for i in range(200)]
    pages = q.paginate(items, budget=500)
    assert len(pages) > 5 and [x for pg in pages for x in pg] == items
    assert all(sum(len(json.dumps(x, separators=(",", ":"))) + 1 for x in pg) <= 500 for pg in pages)
    assert q.paginate([], 500) == [[]]
    big = [{"pad": "y" * 1000}, {"n": 1}]
    assert q.paginate(big, 500) == [[big[0]], [big[1]]]  # an item over budget gets a page of its own


# --- protocol samples (every type is sampled: tests/test_protocol.py) ---------------------------------

CALLER = p.QueryCaller(uid=1001, user=DEV_USER, admin=False)
QJOB = p.QueryJob(job_id="8", node="n1", job_class="opportunistic", gpus=[0], visible=True, mem_limit_bytes=4 * GiB,
                  mem_used_bytes=2 * GiB, compute_share=0.5, iteration_ms=51.5, paused=False)
HIDDEN = p.QueryJob(job_id="7", node="n1", job_class="guaranteed", gpus=[0], visible=False, mem_limit_bytes=None,
                    mem_used_bytes=None, compute_share=None, iteration_ms=None, paused=None)
QUERY_SAMPLES = [
    p.QueryJobs(credential="MUNGE:abc:", page=0),
    p.QueryJobsReply(caller=CALLER, page=0, pages=1, jobs=[QJOB, HIDDEN]),
    p.QueryNodes(credential="MUNGE:abc:", page=2),
    p.QueryNodesReply(caller=CALLER, page=0, pages=1, nodes=[p.QueryNode(
        node="n1", telemetry="nvml", report_unix=1.7e9, unhealthy="",
        gpus=[p.QueryGpu(index=0, memory_used_bytes=1, memory_total_bytes=2, utilization=0.5, util_measured=True,
                         jobs=["7", "8"])], jobs=[QJOB, HIDDEN])]),
    p.QueryExplain(credential="MUNGE:abc:", job_id="8"),
    p.QueryExplainReply(caller=CALLER, job_id="8", owner=DEV_USER, omitted=0,
                        records=[{"ts": 1.7e9, "kind": "paused", "job_id": "8", "params": {}, "user": DEV_USER}]),
]


@pytest.mark.parametrize("body", QUERY_SAMPLES, ids=lambda b: type(b).TYPE)
def test_query_messages_round_trip(body):
    back = p.decode(p.encode(p.message(body, ref="r-1")))
    assert back.body == body and back.ref == "r-1"


def test_query_types_travel_on_the_query_socket_only():
    new = {type(b).TYPE for b in QUERY_SAMPLES}
    assert new - {"query_jobs_reply", "query_nodes_reply", "query_explain_reply"} <= p.QUERY_REQUESTS
    assert not new & (p.AGENT_TO_SIDECAR | p.SIDECAR_TO_AGENT | p.CONTROL_REQUESTS | p.CONTROL_REPLIES
                      | p.SIDECAR_TO_COORDINATOR | p.COORDINATOR_TO_SIDECAR)
    with pytest.raises(p.ProtocolError) as e:  # an older sidecar's control socket, asked by mistake
        p.decode(p.encode(p.message(QUERY_SAMPLES[0])), p.CONTROL_REQUESTS)
    assert e.value.code is p.ErrorCode.wrong_direction


def test_the_payload_binds_the_request_and_leaves_the_credential_out():
    a = p.query_payload("id-1", p.QueryExplain(credential="one", job_id="8"))
    assert a == p.query_payload("id-1", p.QueryExplain(credential="two", job_id="8"))
    assert a != p.query_payload("id-2", p.QueryExplain(credential="one", job_id="8"))
    assert a != p.query_payload("id-1", p.QueryExplain(credential="one", job_id="9"))
    assert a != p.query_payload("id-1", p.QueryJobs(credential="one", page=0))


# --- the server, over ZeroMQ ---------------------------------------------------------------------------

@pytest.fixture
def server(tmp_path, munged):
    audit_log = tmp_path / "audit.jsonl"
    audit_log.write_text("")
    owners = {"9": DEV_USER}

    def factory(v):
        return q.QueryHandler(v, str(audit_log), owner_lookup=owners.get)
    srv = q.QueryServer("tcp://127.0.0.1:*", factory)
    srv.start()
    srv.publish(view())
    srv.audit_log = audit_log  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def _dev_asks(endpoint: str, what: str, arg: str = "") -> dict:
    """antman-dev's own process asks, through clients.coordinator_query as the CLI does; JSON of what came back."""
    code = f"""
import json
from slurm_antman import protocol as p
from slurm_antman.clients import coordinator_query as qc
try:
    if {what!r} == "explain":
        r = qc.explain({endpoint!r}, {arg!r})
        out = {{"caller": p.body_dict(r.caller), "owner": r.owner, "kinds": [x["kind"] for x in r.records]}}
    else:
        caller, items = getattr(qc, {what!r})({endpoint!r})
        out = {{"caller": p.body_dict(caller), "items": [p.body_dict(i) for i in items]}}
except qc.QueryRefused as e:
    out = {{"refused": e.code, "message": e.message}}
print(json.dumps(out))
"""
    r = as_user_python(code)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_root_and_antman_dev_each_get_what_they_may_see(server, dev_user):
    caller, rows = qc.jobs(server.endpoint)
    assert (caller.uid, caller.user, caller.admin) == (0, "root", True)
    assert {r.job_id for r in rows if r.visible} == {"7", "8", "9", "10"}

    got = _dev_asks(server.endpoint, "jobs")
    assert got["caller"] == {"uid": dev_user.pw_uid, "user": DEV_USER, "admin": False}
    rows = {r["job_id"]: r for r in got["items"]}
    assert set(rows) == {"7", "8", "9", "10"}
    assert rows["8"]["visible"] and rows["8"]["mem_used_bytes"] == 2 * GiB and rows["8"]["paused"] is True
    assert rows["9"]["visible"] and rows["9"]["iteration_ms"] == 51.5
    for other in ("7", "10"):
        assert not rows[other]["visible"] and all(rows[other][k] is None for k in DETAILS)

    nodes = {n["node"]: n for n in _dev_asks(server.endpoint, "nodes")["items"]}
    assert nodes["n1"]["gpus"][0]["jobs"] == ["7", "8"]
    assert {j["job_id"]: j["visible"] for j in nodes["n1"]["jobs"]} == {"7": False, "8": True}


def _audit(path, *recs: dict) -> None:
    with open(path, "a") as f:
        for r in recs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def test_explain_answers_a_jobs_owner_and_admins_only(server, dev_user):
    base = {"outcome": "ok", "params": {}, "reason": "why"}
    _audit(server.audit_log,
           {"ts": 1.0, "kind": "placed", "job_id": "7", "node": "n1", "user": "root", **base,
            "params": {"gpus": [0], "placement": "fit", "job_class": "opportunistic", "restarts": 0}},
           {"ts": 2.0, "kind": "paused", "job_id": "8", "node": "n1", "user": DEV_USER, **base},
           {"ts": 3.0, "kind": "resumed", "job_id": "8", "node": "n1", "user": DEV_USER, **base},
           {"ts": 4.0, "kind": "upgrade", "job_id": "9", **base},     # written before records named users
           {"ts": 5.0, "kind": "upgrade", "job_id": "12", **base},    # ... of a job nobody can place
           {"ts": 6.0, "kind": "state", "state": {"job_id": "8"}})   # not a record of the job
    server.publish(q.QueryView(reports=view().reports, owners=MappingProxyType({"7": "root"})))
    root = qc.explain(server.endpoint, "8")
    assert root.caller.admin and [r["kind"] for r in root.records] == ["paused", "resumed"] and root.owner == DEV_USER
    assert [r["kind"] for r in qc.explain(server.endpoint, "12").records] == ["upgrade"]

    assert _dev_asks(server.endpoint, "explain", "8") == {
        "caller": {"uid": dev_user.pw_uid, "user": DEV_USER, "admin": False}, "owner": DEV_USER,
        "kinds": ["paused", "resumed"]}
    assert _dev_asks(server.endpoint, "explain", "9")["kinds"] == ["upgrade"]  # Slurm's word: antman-dev's
    assert _dev_asks(server.endpoint, "explain", "7") == {
        "refused": "forbidden", "message": "job 7 is not yours: only its owner and admins see its story"}
    assert _dev_asks(server.endpoint, "explain", "12")["refused"] == "forbidden"
    assert _dev_asks(server.endpoint, "explain", "13")["kinds"] == []  # nothing recorded: nothing to hide


def test_a_long_story_keeps_its_newest_records(tmp_path, munged):
    log = tmp_path / "audit.jsonl"
    _audit(log, *({"ts": float(i), "kind": "keep_off", "job_id": "5", "params": {"nodes": ["n1"]}, "reason": "x" * 100,
                   "outcome": "ok", "user": "root"} for i in range(50)))
    h = q.QueryHandler(lambda: view(), str(log), page_bytes=2000)
    reply = h.handle(_request(p.QueryExplain(credential="", job_id="5")))
    assert isinstance(reply.body, p.QueryExplainReply)
    assert reply.body.omitted > 0 and len(reply.body.records) + reply.body.omitted == 50
    assert reply.body.records[-1]["ts"] == 49.0


def test_pages_carry_every_row_once(munged):
    many = {f"n{i}": _report(f"n{i}", [_rjob(str(100 + i), GiB)], time.time()) for i in range(40)}
    srv = q.QueryServer("tcp://127.0.0.1:*", lambda v: q.QueryHandler(v, "/nonexistent", page_bytes=1500))
    srv.start()
    try:
        srv.publish(q.QueryView(reports=MappingProxyType(many)))
        first = qc.request(srv.endpoint, p.QueryJobs(credential="", page=0))
        assert first.pages > 3
        _, rows = qc.jobs(srv.endpoint)
        assert sorted(r.job_id for r in rows) == sorted(str(100 + i) for i in range(40))
        _, nodes = qc.nodes(srv.endpoint)
        assert len(nodes) == 40
        with pytest.raises(qc.QueryRefused) as e:
            qc.request(srv.endpoint, p.QueryJobs(credential="", page=first.pages))
        assert e.value.code == "bad_value" and "past the last page" in e.value.message
    finally:
        srv.stop()


# --- refused requests ----------------------------------------------------------------------------------

def _request(body: p.Body, msg_id: str | None = None, credential: str | None = None, ttl: int | None = None) -> list:
    """Frames of a query request with a credential of this process made for it (or ``credential``)."""
    import dataclasses

    msg_id = msg_id or p.new_id()
    cred = credential if credential is not None else munge.encode(p.query_payload(msg_id, body), ttl=ttl)
    return p.encode(p.Message(body=dataclasses.replace(body, credential=cred), id=msg_id))


def _env(**over) -> list:
    env = {"v": 1, "type": "query_jobs", "id": "x-1", "ts": 1.0, "ref": None, "body": {"credential": "c", "page": 0}}
    env.update(over)
    return [p.MARKER, json.dumps(env).encode()]


@pytest.fixture
def dealer(server):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.endpoint)

    def ask(frames: list) -> p.Message:
        s.send_multipart(frames)
        assert s.poll(5000), "no answer"
        return p.decode(s.recv_multipart())
    yield ask
    s.close(0)


def _code(reply: p.Message) -> str:
    assert isinstance(reply.body, p.Error), reply
    return reply.body.code


def test_bad_expired_replayed_and_missing_credentials_get_their_own_errors(dealer):
    frames = _request(p.QueryJobs(credential="", page=0))
    assert isinstance(dealer(frames).body, p.QueryJobsReply)
    again = dealer(frames)  # the same request, captured and sent once more
    assert _code(again) == "replayed_credential" and "Replayed" in again.body.message
    assert again.ref == p.decode(frames).id

    stale = _request(p.QueryJobs(credential="", page=0), ttl=1)
    time.sleep(2.2)
    assert _code(dealer(stale)) == "expired_credential"

    # A good credential made for another request (here: another job) is not this request's.
    other = munge.encode(p.query_payload("id-1", p.QueryExplain(credential="", job_id="7")))
    moved = dealer(_request(p.QueryExplain(credential="", job_id="8"), msg_id="id-1", credential=other))
    assert _code(moved) == "bad_credential" and "another request" in moved.body.message

    assert _code(dealer(_request(p.QueryJobs(credential="", page=0), credential="MUNGE:forged:"))) == "bad_credential"
    assert _code(dealer(_request(p.QueryJobs(credential="", page=0), credential=""))) == "bad_credential"
    missing = dealer(_env(body={"page": 0}))
    assert _code(missing) == "missing_field" and "credential" in missing.body.message


def test_malformed_requests_are_answered_with_errors(dealer):
    cases = [
        (_env(v=2), "version_mismatch"),
        (_env(type="bogus"), "unknown_type"),
        (_env(type="node_report"), "wrong_direction"),
        (_env(body={"credential": "c", "page": -1}), "bad_value"),
        (_env(body={"credential": 7, "page": 0}), "bad_type"),
        (_env(body={"credential": "c", "page": 0, "uid": 0}), "extra_field"),  # a uid of one's own: refused
        (_env(type="query_explain", body={"credential": "c", "job_id": "../7"}), "bad_value"),
        ([p.MARKER, b"{not json"], "bad_json"),
        ([p.MARKER, b"[" * 50_000], "bad_json"),  # nested too deeply for the decoder
        ([b"NOTANTMAN", b"{}"], "bad_frames"),
        ([p.MARKER], "bad_frames"),
    ]
    for frames, code in cases:
        assert _code(dealer(frames)) == code, frames[:1]
    # Over the bound, libzmq drops the connection (below); a handler given one anyway refuses it.
    h = q.QueryHandler(lambda: view(), "/nonexistent")
    assert _code(h.handle([p.MARKER, b" " * (q.MAX_REQUEST_BYTES + 1)])) == "too_large"
    version = dealer(_env(v=2))
    assert "v2" in version.body.message and "v1" in version.body.message
    assert isinstance(dealer(p.encode(p.message(p.Heartbeat()))).body, p.Heartbeat)


def test_fuzzed_and_oversized_requests_leave_the_server_serving(server, dealer):
    rnd = random.Random(26)
    for _ in range(200):
        frames = [rnd.randbytes(rnd.randint(0, 300)) for _ in range(rnd.randint(1, 4))]
        if rnd.random() < 0.5:
            frames[0] = p.MARKER
        reply = dealer(frames)
        assert isinstance(reply.body, p.Error)
    # Over MAXMSGSIZE: libzmq drops that connection; others go on being served.
    ctx = zmq.Context.instance()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(server.endpoint)
    big.send_multipart([p.MARKER, b"x" * (q.MAX_REQUEST_BYTES + 10)])
    assert not big.poll(500)
    big.close(0)
    ok = dealer(_request(p.QueryNodes(credential="", page=0)))
    assert isinstance(ok.body, p.QueryNodesReply)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=4),
       st.dictionaries(st.sampled_from(["v", "type", "id", "ts", "ref", "body"]),
                       st.one_of(st.none(), st.integers(), st.text(max_size=20), st.dictionaries(
                           st.sampled_from(["credential", "page", "job_id", "x"]),
                           st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=20)), max_size=3))))
def test_the_handler_answers_anything_with_a_message(frames, env):
    h = q.QueryHandler(lambda: view(), "/nonexistent", decode=lambda c: (_ for _ in ()).throw(
        munge.CredentialError("refused by this test")))
    for f in (frames, [p.MARKER, json.dumps(env).encode()]):
        reply = h.handle(f, "peer")
        assert isinstance(reply, p.Message)
        p.encode(reply)  # and it can be sent


def test_requests_are_rate_limited_per_address_and_per_user(munged):
    clock = [0.0]
    h = q.QueryHandler(lambda: view(), "/nonexistent", monotonic=lambda: clock[0])
    beat = p.encode(p.message(p.Heartbeat()))
    burst = int(q.PEER_RATE[1])
    assert all(isinstance(h.handle(beat, "10.0.0.1").body, p.Heartbeat) for _ in range(burst))
    assert _code(h.handle(beat, "10.0.0.1")) == "rate_limited"
    assert isinstance(h.handle(beat, "10.0.0.2").body, p.Heartbeat)  # another host is not held back
    clock[0] += 1.0
    assert isinstance(h.handle(beat, "10.0.0.1").body, p.Heartbeat)  # the bucket refills

    per_uid = int(q.UID_RATE[1])
    replies = [h.handle(_request(p.QueryJobs(credential="", page=0)), f"10.1.0.{i}") for i in range(per_uid + 1)]
    assert all(isinstance(r.body, p.QueryJobsReply) for r in replies[:per_uid])
    assert _code(replies[-1]) == "rate_limited" and "this user" in replies[-1].body.message


def test_a_handler_bug_is_an_internal_error_not_a_crash(munged):
    def broken():
        raise RuntimeError("view exploded")
    h = q.QueryHandler(broken, "/nonexistent")
    reply = h.handle(_request(p.QueryJobs(credential="", page=0)))
    assert _code(reply) == "internal" and "view exploded" in reply.body.message


def test_no_munged_on_the_coordinator_is_one_clear_error(tmp_path):
    h = q.QueryHandler(lambda: view(), "/nonexistent",
                       decode=lambda c: munge.decode(c, socket=str(tmp_path / "none.socket")))
    frames = p.encode(p.message(p.QueryJobs(credential="MUNGE:x:", page=0)))
    reply = h.handle(frames)
    assert _code(reply) == "internal" and "cannot check munge credentials" in reply.body.message


# --- the client side -----------------------------------------------------------------------------------

def test_a_coordinator_that_does_not_answer_is_one_line_naming_it(munged):
    with zmq.Context.instance().socket(zmq.REP) as s:
        port = s.bind_to_random_port("tcp://127.0.0.1")
        # Bound but never answering: the client's deadline, then a line naming the endpoint.
        t0 = time.monotonic()
        with pytest.raises(qc.CoordinatorUnreachable) as e:
            qc.jobs(f"tcp://127.0.0.1:{port}", timeout_s=0.5)
        assert time.monotonic() - t0 < 3
    assert str(e.value) == f"the coordinator does not answer at tcp://127.0.0.1:{port} (waited 0.5 s)"
    assert "\n" not in str(e.value)


def test_a_newer_coordinator_is_a_clear_error_not_a_crash(munged):
    with zmq.Context.instance().socket(zmq.ROUTER) as s:
        port = s.bind_to_random_port("tcp://127.0.0.1")
        import threading

        def answer_as_v2():
            if s.poll(5000):
                ident, _, raw = s.recv_multipart()
                env = json.loads(raw)
                reply = {"v": 2, "type": "query_jobs_reply", "id": "c-1", "ts": 1.0, "ref": env["id"],
                         "body": {"rows": []}}
                s.send_multipart([ident, p.MARKER, json.dumps(reply).encode()])
        t = threading.Thread(target=answer_as_v2)
        t.start()
        with pytest.raises(qc.QueryError, match="speaks antman protocol v2, this antman v1"):
            qc.jobs(f"tcp://127.0.0.1:{port}")
        t.join()


def test_slurms_word_on_an_owner_is_asked_once():
    from slurm_antman.slurm import SlurmUnavailable

    asked: list[int] = []

    class Backend:
        def job_user(self, job_id: int):
            asked.append(job_id)
            if job_id == 3:
                raise SlurmUnavailable("slurmctld is down", ["scontrol"])
            return {1: "alice"}.get(job_id)

    clock = [0.0]
    lookup = q.slurm_owner(Backend(), monotonic=lambda: clock[0], retry_s=60)
    assert [lookup("1"), lookup("1"), lookup("2"), lookup("2"), lookup("3"), lookup("3")] == [
        "alice", "alice", None, None, None, None]
    assert asked == [1, 2, 3]
    clock[0] = 61.0
    assert lookup("2") is None and lookup("1") == "alice" and asked == [1, 2, 3, 2]
