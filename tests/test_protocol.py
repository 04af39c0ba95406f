"""The wire protocol: round trips, every malformed case with its error code, version mismatch."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_antman import protocol as p


def _report(**kw):
    base = dict(iteration=7, iterations=2, iteration_ms=120.5, busy_ms=80.0, mem_allocated_bytes=1 << 30,
                mem_reserved_bytes=2 << 30, mem_peak_bytes=3 << 30, spilled_bytes=0, limits_seq=3)
    base.update(kw)
    return p.Report(**base)


SAMPLES = [
    p.Register(job_id="42", pid=100, rank=0, local_rank=0, world_size=1, hostname="n1", agent_version="0.1",
               torch_version="2.13.0", device="cuda", job_class="opportunistic"),
    p.Register(job_id="42", pid=100, rank=1, local_rank=1, world_size=2, hostname="n1", agent_version="0.1",
               torch_version="2.13.0", device="cpu", job_class="none", cuda_visible_devices="0,1"),
    p.Registered(job_id="42", job_class="guaranteed", seq=0, mem_limit_bytes=None, compute_share=1.0,
                 heartbeat_s=1.0, throttle="off"),
    _report(),
    p.Registered(job_id="42", job_class="opportunistic", seq=3, mem_limit_bytes=1 << 30, compute_share=0.5,
                 heartbeat_s=1.0, throttle="launch", slot_page="/run/slurm-antman/n1/slots/gpu0.slots",
                 slot_role="fill"),
    p.Limits(seq=4, mem_limit_bytes=5 << 30, compute_share=0.25),
    p.Limits(seq=5, mem_limit_bytes=None, compute_share=1.0, slot_page="/run/slurm-antman/n1/slots/gpu3.slots",
             slot_role="publish"),
    p.Ack(seq=4, applied_iteration=9),
    p.Preempt(deadline_unix=1.7e9, grace_s=30.0, reason="guaranteed job 41 needs memory"),
    p.Register(job_id="42", pid=100, rank=0, local_rank=0, world_size=1, hostname="n1", agent_version="0.2",
               torch_version="2.13.0", device="cuda", job_class="opportunistic", features=("pause", "later")),
    p.Pause(seq=1, reason="guaranteed job 41 needs GPU 0's memory"),
    p.Paused(seq=1, bytes_freed=3 << 30, bytes_moved=3 << 30, pause_ms=12.5),
    p.Resume(seq=1),
    p.Resumed(seq=1, resume_ms=4.0),
    p.Width(seq=2, gpus=[0, 3], reason="guaranteed job 41 claims GPU 1"),
    p.WidthDone(seq=2, checkpoint_ms=80.0),
    p.Checkpoint(seq=1, at_unix=1.7e9, reason="task 5_1 of elastic array 5 leaves"),
    p.CheckpointDone(seq=1, checkpoint_ms=35.0, late_ms=-240.0),
    p.Heartbeat(),
    p.Error(code="bad_json", message="x"),
    p.Bye(reason="exit"),
    p.JobRegister(job_id="43", uid=1000, user="alice", job_class="opportunistic", gpus=1),
    p.JobRegister(job_id="44", uid=1000, gid=1000, user="alice", job_class="guaranteed", gpus=2,
                  physical_gpus=[0, 3]),
    p.JobRegister(job_id="45", uid=1000, user="alice", job_class="opportunistic", gpus=4, elastic_min=2),
    p.JobRegisterReply(job_id="43", gpus=[1], endpoint="ipc:///run/x/jobs/43/agent.sock", placement="fit", note=""),
    p.JobRetire(job_id="43"),
    p.JobRetireReply(job_id="43", known=False),
    p.NodeState(),
    p.NodeStateReply(
        node="n1", telemetry="emulated", sidecar_version="0.1.0",
        gpus=[p.GpuState(index=0, memory_used_bytes=1, memory_total_bytes=2, utilization=0.5,
                         utilization_avg=0.4, jobs=["43"])],
        jobs=[p.JobState(job_id="43", job_class="opportunistic", uid=1000, gpus=[0], mem_limit_bytes=None,
                         mem_used_bytes=0, compute_share=0.5, iteration_ms=None, baseline_ms=None,
                         last_report_unix=None, agents=0, limits_seq=0, acked_seq=0)],
        preemptions=[p.PreemptState(job_id="43", reason="r", requested_unix=1.0, deadline_unix=31.0)]),
]


def test_every_type_has_a_sample():
    # The uplink's types are sampled (and round-tripped) in test_uplink_protocol.py, the query
    # channel's in test_query.py.
    from test_query import QUERY_SAMPLES
    from test_uplink_protocol import UPLINK_SAMPLES
    assert {type(s).TYPE for s in [*SAMPLES, *UPLINK_SAMPLES, *QUERY_SAMPLES]} == set(p.BODY_TYPES)


@pytest.mark.parametrize("body", SAMPLES, ids=lambda b: type(b).TYPE)
def test_round_trip(body):
    msg = p.message(body, ref="abc-1")
    frames = p.encode(msg)
    assert frames[0] == p.MARKER
    back = p.decode(frames)
    assert back.body == body
    assert (back.id, back.ref, back.v, back.type) == (msg.id, "abc-1", 1, type(body).TYPE)
    assert back.ts == pytest.approx(msg.ts)


def test_ids_are_unique():
    assert len({p.new_id() for _ in range(1000)}) == 1000


def _env(body_type="report", body=None, **env):
    e = {"v": 1, "type": body_type, "id": "m1", "ts": 1.5, "ref": None,
         "body": body if body is not None else p.body_dict(_report())}
    e.update(env)
    return e


def _frames(env) -> list[bytes]:
    return [p.MARKER, json.dumps(env).encode()]


def _code(frames, accept=None) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as ei:
        p.decode(frames, accept)
    return ei.value


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


MALFORMED = [
    ("one frame", [b"{}"], "bad_frames"),
    ("three frames", [p.MARKER, b"{}", b"x"], "bad_frames"),
    ("wrong marker", [b"JUPYTER", b"{}"], "bad_frames"),
    ("too large", [p.MARKER, b" " * (p.MAX_MESSAGE_BYTES + 1)], "too_large"),
    ("not json", [p.MARKER, b"{nope"], "bad_json"),
    ("not utf8", [p.MARKER, b"\xff\xfe{}"], "bad_json"),
    ("array envelope", [p.MARKER, b"[1,2]"], "bad_envelope"),
    ("no v", _frames(_without(_env(), "v")), "bad_envelope"),
    ("string v", _frames(_env(v="1")), "bad_envelope"),
    ("missing ts", _frames(_without(_env(), "ts")), "missing_field"),
    ("extra envelope field", _frames(_env(extra=1)), "extra_field"),
    ("empty id", _frames(_env(id="")), "bad_envelope"),
    ("numeric type", _frames(_env(body_type=5)), "bad_envelope"),
    ("NaN ts", [p.MARKER, json.dumps(_env()).replace('"ts": 1.5', '"ts": NaN').encode()], "bad_envelope"),
    ("numeric ref", _frames(_env(ref=3)), "bad_envelope"),
    ("body list", _frames(_env(body=[])), "bad_envelope"),
    ("unknown type", _frames(_env(body_type="launch_missiles", body={})), "unknown_type"),
    ("missing body field", _frames(_env(body=_without(p.body_dict(_report()), "busy_ms"))), "missing_field"),
    ("extra body field", _frames(_env(body={**p.body_dict(_report()), "gpu_temp": 3})), "extra_field"),
    ("string for int", _frames(_env(body={**p.body_dict(_report()), "iteration": "7"})), "bad_type"),
    ("float for int", _frames(_env(body={**p.body_dict(_report()), "iteration": 7.0})), "bad_type"),
    ("bool for int", _frames(_env(body={**p.body_dict(_report()), "spilled_bytes": True})), "bad_type"),
    ("negative", _frames(_env(body={**p.body_dict(_report()), "mem_peak_bytes": -1})), "bad_value"),
    ("share > 1", _frames(_env("limits", {"seq": 1, "mem_limit_bytes": None, "compute_share": 1.5})), "bad_value"),
    ("share 0", _frames(_env("limits", {"seq": 1, "mem_limit_bytes": None, "compute_share": 0})), "bad_value"),
    ("null not allowed", _frames(_env("limits", {"seq": 1, "mem_limit_bytes": 1, "compute_share": None})), "bad_type"),
    ("bad enum", _frames(_env("job_register", {"job_id": "1", "uid": 0, "user": "u", "job_class": "auto",
                                               "gpus": 1})), "bad_value"),
    ("path in job id", _frames(_env("job_retire", {"job_id": "../1"})), "bad_value"),
    ("bad list item", _frames(_env("job_register", {"job_id": "1", "uid": 0, "user": "u", "job_class": "guaranteed",
                                                    "gpus": 1, "physical_gpus": [0, "1"]})), "bad_type"),
    ("unknown error code", _frames(_env("error", {"code": "oops", "message": "m"})), "bad_value"),
]


@pytest.mark.parametrize("frames,code", [(f, c) for _, f, c in MALFORMED], ids=[n for n, _, _ in MALFORMED])
def test_malformed_gets_specific_code(frames, code):
    err = _code(frames)
    assert err.code.value == code, str(err)


def test_error_names_the_field_and_keeps_ref():
    err = _code(_frames(_env(id="req-9", body={**p.body_dict(_report()), "iteration_ms": "slow"})))
    assert "report.iteration_ms" in err.message and "expected number, got string" in err.message
    assert err.ref == "req-9"
    err = _code(_frames(_env(body={**p.body_dict(_report()), "gpu_temp": 3})))
    assert "gpu_temp" in err.message and "busy_ms" in err.message  # lists the allowed fields


def test_nested_field_error_path():
    body = p.body_dict(SAMPLES[-1])
    body["gpus"][0]["utilization"] = 2
    err = _code(_frames(_env("node_state_reply", body)))
    assert err.code is p.ErrorCode.bad_value and "node_state_reply.gpus[0].utilization" in err.message


def test_version_mismatch_names_both_versions():
    # A v2 peer may have changed everything else, so the version is checked first.
    err = _code(_frames({"v": 2, "type": "hello_v2", "id": "x", "whatever": 1}))
    assert err.code is p.ErrorCode.version_mismatch
    assert err.peer_version == 2
    assert "peer speaks antman protocol v2, this side speaks v1" in err.message


def test_wrong_direction():
    frames = p.encode(p.message(p.Limits(seq=1, mem_limit_bytes=None, compute_share=1.0)))
    err = _code(frames, p.AGENT_TO_SIDECAR)
    assert err.code is p.ErrorCode.wrong_direction and "'limits'" in err.message
    assert p.decode(frames, p.SIDECAR_TO_AGENT).type == "limits"


def test_encode_rejects_invalid_body():
    with pytest.raises(p.ProtocolError) as ei:
        p.encode(p.message(p.Limits(seq=1, mem_limit_bytes=None, compute_share=2.0)))
    assert ei.value.code is p.ErrorCode.bad_value
    with pytest.raises(p.ProtocolError) as ei:
        p.encode(p.message(_report(iteration_ms=float("nan"))))
    assert ei.value.code is p.ErrorCode.bad_value


def test_optional_fields_default():
    body = {"job_id": "5", "uid": 1, "user": "u", "job_class": "opportunistic", "gpus": 1}
    msg = p.decode(_frames(_env("job_register", body)))
    assert msg.body.physical_gpus is None and msg.body.gid is None


def test_int_accepted_for_number():
    body = {**p.body_dict(_report()), "iteration_ms": 100}
    msg = p.decode(_frames(_env(body=body)))
    assert msg.body.iteration_ms == 100.0 and isinstance(msg.body.iteration_ms, float)


def test_endpoint_paths():
    assert p.agent_path("/run/a", "12") == "/run/a/jobs/12/agent.sock"
    assert p.control_path("/run/a") == "/run/a/control.sock"
    with pytest.raises(ValueError, match="1-10 digits"):
        p.job_dir("/run/a", "../etc")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(p.BODY_TYPES)), st.dictionaries(st.text(max_size=12), json_values, max_size=6))
def test_random_bodies_decode_or_raise_protocol_error(mtype, body):
    frames = _frames(_env(mtype, body))
    try:
        msg = p.decode(frames)
    except p.ProtocolError as e:
        assert e.code in set(p.ErrorCode)
    else:
        assert msg.type == mtype


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_frames_raise_only_protocol_error(frames):
    try:
        p.decode(frames)
    except p.ProtocolError:
        pass


@pytest.mark.parametrize("gpus", [[], [1, 1], list(range(65))])
def test_width_refuses_an_empty_repeated_or_too_long_gpu_list(gpus):
    # A rule across the list's items: decoding must say bad_value, not raise ValueError at a daemon.
    frames = p.encode(p.message(p.Width(seq=1, gpus=[0], reason="r")))
    env = json.loads(frames[1])
    env["body"]["gpus"] = gpus
    with pytest.raises(p.ProtocolError) as e:
        p.decode([frames[0], json.dumps(env).encode()], accept=p.SIDECAR_TO_AGENT)
    assert e.value.code == p.ErrorCode.bad_value and "width.gpus" in e.value.message


# --- the idle-slot page's fields (docs/protocol.md, "The idle-slot page") ----------------------------

PAGE = "/run/slurm-antman/n1/slots/gpu0.slots"
OLD_REGISTERED_FIELDS = {"job_id", "job_class", "seq", "mem_limit_bytes", "compute_share", "heartbeat_s", "throttle"}


def _registered(**kw):
    base = dict(job_id="42", job_class="guaranteed", seq=0, mem_limit_bytes=None, compute_share=1.0,
                heartbeat_s=1.0, throttle="off")
    base.update(kw)
    return p.Registered(**base)


def test_slot_fields_stay_off_the_wire_while_null_so_an_older_agent_never_meets_them():
    body = json.loads(p.encode(p.message(_registered()))[1])["body"]
    assert set(body) == OLD_REGISTERED_FIELDS
    lim = json.loads(p.encode(p.message(p.Limits(seq=1, mem_limit_bytes=None, compute_share=1.0)))[1])["body"]
    assert set(lim) == {"seq", "mem_limit_bytes", "compute_share"}
    # Absent decodes as null: "no page" reads the same either way.
    back = p.decode(p.encode(p.message(_registered())), p.SIDECAR_TO_AGENT).body
    assert (back.slot_page, back.slot_role) == (None, None)
    sent = json.loads(p.encode(p.message(_registered(slot_page=PAGE, slot_role="publish")))[1])["body"]
    assert (sent["slot_page"], sent["slot_role"]) == (PAGE, "publish")


def _slot_body(mtype, **fields):
    base = p.body_dict(_registered()) if mtype == "registered" else {"seq": 2, "mem_limit_bytes": None,
                                                                         "compute_share": 1.0}
    return _frames(_env(mtype, {**base, **fields}))


@pytest.mark.parametrize("mtype", ["registered", "limits"])
def test_a_slot_role_that_is_not_publish_or_fill_is_named(mtype):
    err = _code(_slot_body(mtype, slot_page=PAGE, slot_role="write"), p.SIDECAR_TO_AGENT)
    assert err.code is p.ErrorCode.bad_value
    assert f"{mtype}.slot_role: 'write' is not allowed; allowed: fill, publish" in err.message


@pytest.mark.parametrize("mtype", ["registered", "limits"])
def test_a_slot_page_path_over_255_characters_or_not_absolute_is_refused(mtype):
    longest = "/" + "a" * (p.MAX_SLOT_PAGE_PATH - 1)
    assert p.decode(_slot_body(mtype, slot_page=longest, slot_role="fill")).body.slot_page == longest
    err = _code(_slot_body(mtype, slot_page=longest + "a", slot_role="fill"))
    assert err.code is p.ErrorCode.bad_value and f"{mtype}.slot_page: longer than 255 characters" in err.message
    for bad in ("slots/gpu0.slots", "/run/x\n/gpu0.slots", "/run/x\x00y"):
        err = _code(_slot_body(mtype, slot_page=bad, slot_role="fill"))
        assert err.code is p.ErrorCode.bad_value and f"{mtype}.slot_page" in err.message, bad
    err = _code(_slot_body(mtype, slot_page=7, slot_role="fill"))
    assert err.code is p.ErrorCode.bad_type


@pytest.mark.parametrize("fields", [dict(slot_page=PAGE), dict(slot_role="fill"),
                                    dict(slot_page=PAGE, slot_role=None), dict(slot_page=None, slot_role="publish")])
def test_a_slot_page_and_its_role_come_together(fields):
    err = _code(_slot_body("limits", **fields))
    assert err.code is p.ErrorCode.bad_value and "slot_page and slot_role come together" in err.message
    with pytest.raises(ValueError, match="come together"):
        _registered(**fields)


def test_encode_refuses_a_slot_role_the_agent_would_refuse():
    # A sender bug fails at the sender, never as an agent's error.
    with pytest.raises(p.ProtocolError) as ei:
        p.encode(p.message(p.Limits(seq=1, mem_limit_bytes=None, compute_share=1.0, slot_page=PAGE,
                                    slot_role="read")))
    assert ei.value.code is p.ErrorCode.bad_value and "slot_role" in ei.value.message


def test_the_slots_feature_is_one_more_register_feature():
    assert p.FEATURE_SLOTS == "slots" and p.SLOT_ROLES == ("publish", "fill")
    reg = p.Register(job_id="42", pid=100, rank=0, local_rank=0, world_size=1, hostname="n1", agent_version="0.3",
                     torch_version="2.13.0", device="cuda", job_class="guaranteed", features=(p.FEATURE_SLOTS,))
    assert p.decode(p.encode(p.message(reg))).body.features == ("slots",)
