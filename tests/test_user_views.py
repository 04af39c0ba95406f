"""What ordinary users see (docs/user.md, "Who sees what"): the views' rows with the coordinator's
answers, the coordinator daemon serving its own snapshot, and `antman explain` as antman-dev; a real
munged and real sockets, no Slurm (tests/test_user_views_cluster.py runs the same on the devcluster)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from types import MappingProxyType

import pytest
import yaml

from slurm_antman import config as cfgmod
from slurm_antman.coordinator import query as q
from slurm_antman.clients import coordinator_query as qc
from slurm_antman.slurm.models import Job
from slurm_antman.views import live
from slurm_antman.views import nodes as nodes_view
from slurm_antman.views import squeue as squeue_view
from test_munge import DEV_USER, as_user, as_user_python, dev_user, munged  # noqa: F401 - fixtures
from test_query import GiB, _report, _rjob, view

# --- config --------------------------------------------------------------------------------------------

NODES = [{"name": "n[1-2]", "gpus": 2}]


def _cfg(**coordinator) -> cfgmod.AntmanConfig:
    return cfgmod.parse({"nodes": NODES, "coordinator": coordinator})


def test_the_query_endpoint_defaults_beside_the_uplink_and_can_be_set_or_turned_off():
    assert _cfg().coordinator.query_address() == "tcp://127.0.0.1:17903"
    assert _cfg(endpoint="tcp://ctl1.example:5000").coordinator.query_address() == "tcp://ctl1.example:5003"
    assert _cfg(endpoint="tcp://[fd00::1]:5000").coordinator.query_address() == "tcp://[fd00::1]:5003"
    assert _cfg(endpoint="ipc:///run/antman/up").coordinator.query_address() == "ipc:///run/antman/up.query"
    assert _cfg(query_endpoint="tcp://10.0.0.5:6000").coordinator.query_address() == "tcp://10.0.0.5:6000"
    assert _cfg(query_endpoint="off").coordinator.query_address() is None
    assert _cfg(admin_users=["alice", "bob"]).coordinator.admin_users == ["alice", "bob"]
    assert _cfg().coordinator.admin_users == []


@pytest.mark.parametrize("coordinator, text", [
    ({"query_endpoint": "tcp://127.0.0.1:17900"}, "is the sidecars' endpoint"),
    ({"query_endpoint": "http://x:1"}, "coordinator.query_endpoint: 'http://x:1' is not a ZeroMQ endpoint"),
    ({"endpoint": "tcp://h:65533"}, "leaves no room for the default query_endpoint"),
    ({"admin_users": "root"}, "coordinator.admin_users"),
])
def test_a_bad_query_setting_is_a_config_error(coordinator, text):
    with pytest.raises(cfgmod.ConfigError, match=text.replace("(", r"\(").replace(")", r"\)")):
        _cfg(**coordinator)


# --- the views' rows -----------------------------------------------------------------------------------

def _job(job_id: int, user: str, node: str = "n1", state: str = "RUNNING") -> Job:
    return Job(job_id, f"train{job_id}", user, "research", "opportunistic", state, "None", node, [node], 0,
               "antman:class=opportunistic", "", "opportunistic", {node: [0]}, "", None, None)


def _states_as(caller: q.Caller, want: str = "jobs") -> dict[str, live.LiveNode]:
    """What live.gather makes of the coordinator's answer to ``caller``, without the socket."""
    v = view()
    if want == "nodes":
        return {n.node: live.from_query_node(n) for n in q.node_rows(v, caller, time.time())}
    return live.from_query_jobs(q.job_rows(v, caller, time.time()))


DEV = q.Caller(uid=1001, gid=1001, user=DEV_USER, admin=False)
ROOT = q.Caller(uid=0, gid=0, user="root", admin=True)


def test_squeue_rows_show_a_users_own_numbers_and_dashes_for_the_rest(capsys):
    jobs = [_job(7, "root"), _job(8, DEV_USER), _job(12, DEV_USER, state="PENDING")]
    rows = {r["job_id"]: r for r in squeue_view.rows(jobs, _states_as(DEV))}
    own, other, pending = rows[8], rows[7], rows[12]
    assert (own["live"], own["mem_used_bytes"], own["mem_limit_bytes"], own["compute_share"],
            own["iteration_ms"], own["paused"], own["state"]) == ("coordinator", 2 * GiB, 4 * GiB, 0.5, 51.5, True,
                                                                  "PAUSED")
    assert (other["live"], other["user"], other["class"], other["gpus"]) == ("hidden", "root", "opportunistic", [0])
    assert all(other[k] is None for k in ("mem_used_bytes", "mem_limit_bytes", "compute_share", "iteration_ms",
                                          "paused"))
    assert other["state"] == "RUNNING"  # a hidden pause is not shown either
    assert pending["live"] is None and pending["paused"] is False
    # Root sees both.
    rows = {r["job_id"]: r for r in squeue_view.rows(jobs, _states_as(ROOT))}
    assert rows[7]["live"] == "coordinator" and rows[7]["mem_used_bytes"] == GiB
    # The table prints '-' for hidden numbers; the JSON stays parseable.
    squeue_view.render_table(squeue_view.rows(jobs, _states_as(DEV)))
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.strip()[:1].isdigit()}
    assert "2.0G/4.0G" in lines["8"] and "51.5ms" in lines["8"]
    assert "G/" not in lines["7"] and "ms" not in lines["7"].split("opportunistic", 1)[1]
    json.dumps(squeue_view.rows(jobs, _states_as(DEV)))


def test_squeue_rows_of_a_job_on_two_nodes_combine_them_and_hide_if_any_part_is_hidden():
    two = Job(9, "wide", DEV_USER, "research", "opportunistic", "RUNNING", "None", "n[1-2]", ["n1", "n2"], 0,
              "", "", "opportunistic", {"n1": [0], "n2": [0, 1]}, "", None, None)
    states = {"n1": live.LiveNode("n1", "coordinator", None, [], [
        live.LiveJob("9", "opportunistic", [0], True, GiB, 100, 0.5, 10.0, False)]),
        "n2": live.LiveNode("n2", "sidecar", None, [], [
            live.LiveJob("9", "opportunistic", [0, 1], True, 2 * GiB, None, 0.25, 12.0, False)])}
    row = squeue_view.rows([two], states)[0]
    assert (row["mem_limit_bytes"], row["mem_used_bytes"], row["compute_share"], row["iteration_ms"]) == (
        3 * GiB, 100, 0.25, 12.0)
    states["n2"].jobs[0].visible = False
    assert squeue_view.rows([two], states)[0]["live"] == "hidden"


def test_nodes_rows_show_every_gpu_and_job_ids_but_only_own_numbers(capsys):
    from slurm_antman.slurm.models import Node

    slurm_nodes = [Node(n, "MIXED", [], {"gpu": 2}, {"gpu": 1}, ["gpu"], 4, 1, 4000, "") for n in ("n1", "n2", "n3")]
    jobs = [_job(7, "root"), _job(8, DEV_USER)]
    rows = {r["name"]: r for r in nodes_view.rows(slurm_nodes, jobs, _states_as(DEV, "nodes"))}
    n1 = rows["n1"]
    assert n1["sidecar"] and n1["live"] == "coordinator" and n1["telemetry"] == "emulated"
    gpu0 = n1["gpus"][0]
    assert gpu0["memory_used_bytes"] == 3 * GiB and gpu0["utilization"] == gpu0["utilization_avg"] == 0.25
    on = {j["job_id"]: j for j in gpu0["jobs"]}
    assert set(on) == {7, 8}
    assert on[8]["visible"] and on[8]["mem_used_bytes"] == 2 * GiB and on[8]["paused"] is True
    assert not on[7]["visible"] and on[7]["class"] == "opportunistic" and on[7]["mem_used_bytes"] is None
    assert rows["n3"]["gpus"] is None and rows["n3"]["live"] is None  # its sidecar went silent
    nodes_view.render_table(list(rows.values()))
    out = capsys.readouterr().out
    assert "7(opportunistic)" in out and "8(opportunistic)" in out and "no sidecar" in out


def test_gather_asks_the_coordinator_and_falls_back_to_readable_sidecars_only(munged, tmp_path, monkeypatch):
    srv = q.QueryServer("tcp://127.0.0.1:*", lambda v: q.QueryHandler(v, "/nonexistent"))
    srv.start()
    try:
        srv.publish(view())
        cfg = _cfg(query_endpoint=srv.endpoint)
        got, problem = live.gather(cfg, ["n1", "n2"], "jobs")
        assert problem is None and {j.job_id for j in got["n1"].jobs} == {"7", "8"}
        got, problem = live.gather(cfg, ["n1"], "nodes")
        assert problem is None and got["n1"].source == "coordinator" and len(got["n1"].gpus) == 2
        # A node the coordinator says nothing of is asked on this host, where its socket is usable only.
        asked: list = []
        monkeypatch.setattr(live, "sidecar_states", lambda c, nodes, **kw: asked.append(nodes) or {})
        live.gather(cfg, ["n1", "n9"], "jobs")
        assert asked == [["n9"]]
    finally:
        srv.stop()
    assert live._usable(str(tmp_path / "nothing.sock")) is False


def test_a_coordinator_that_does_not_answer_leaves_dashes_and_one_line(munged, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    cfg = _cfg(query_endpoint=f"tcp://127.0.0.1:{port}")
    t0 = time.monotonic()
    got, problem = live.gather(cfg, ["n1"], "jobs")
    assert time.monotonic() - t0 < 2  # refused: known at once, not after the deadline
    assert got == {} and problem == f"the coordinator does not answer at tcp://127.0.0.1:{port} (connection refused)"
    squeue_view.warn_unlive("squeue", problem, missing=True)
    squeue_view.warn_unlive("squeue", problem, missing=False)  # nothing missing: nothing to say
    err = capsys.readouterr().err
    assert err == f"antman squeue: no live numbers from the coordinator: {problem}\n"
    assert live.gather(_cfg(query_endpoint="off"), ["n1"]) == ({}, None)
    assert live.gather(None, ["n1"]) == ({}, None)


# --- the coordinator daemon serves its own snapshot -------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dev_jobs(endpoint: str) -> dict:
    r = as_user_python(
        "import json; from slurm_antman import protocol as p; from slurm_antman.clients import coordinator_query as qc\n"
        f"c, rows = qc.jobs({endpoint!r}); print(json.dumps([p.body_dict(r) for r in rows]))")
    assert r.returncode == 0, r.stderr
    return {r["job_id"]: r for r in json.loads(r.stdout)}


def test_the_coordinator_serves_its_snapshot_and_names_users_in_the_audit_log(munged, dev_user, tmp_path):
    from slurm_antman.coordinator.daemon import Coordinator
    from slurm_antman.slurm import CliBackend

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    audit_log = tmp_path / "audit.jsonl"
    cfg = _cfg(query_endpoint=endpoint, audit_log=str(audit_log), admin_users=[])
    # No Slurm commands on this PATH: no cycle runs; the snapshot's jobs are handed in as a cycle would.
    coord = Coordinator(cfg, backend=CliBackend(env={"PATH": str(tmp_path)}, timeout=5))
    coord.start()
    try:
        assert coord.query is not None and coord.query.endpoint == endpoint
        coord._remember_owners([_job(7, "root"), _job(8, DEV_USER)])
        coord._take([_report("n1", [_rjob("7", GiB), _rjob("8", 2 * GiB, paused=True)], time.time())])
        coord._publish()  # as every cycle does (a report's own publication waits its turn: at most 2 a second)
        rows = _dev_jobs(endpoint)
        assert rows["8"]["visible"] and rows["8"]["mem_used_bytes"] == 2 * GiB
        assert not rows["7"]["visible"] and rows["7"]["mem_used_bytes"] is None
        # The pause it recorded names its user: explain knows the owner after Slurm forgets the job.
        paused = [json.loads(line) for line in audit_log.read_text().splitlines() if '"kind":"paused"' in line]
        assert [(r["job_id"], r["user"]) for r in paused] == [("8", DEV_USER)]
        # admin_users comes with a reload (SIGHUP), no restart.
        path = tmp_path / "antman.yaml"
        path.write_text(yaml.safe_dump({"nodes": NODES, "coordinator": {
            "query_endpoint": endpoint, "audit_log": str(audit_log), "admin_users": [DEV_USER]}}))
        coord.config_path = str(path)
        assert coord.reload()
        assert _dev_jobs(endpoint)["7"]["visible"]
        # Owners are bounded: the oldest jobs are forgotten first (the audit log still names them).
        import slurm_antman.coordinator.daemon as daemon_mod
        old = daemon_mod.MAX_OWNERS
        daemon_mod.MAX_OWNERS = 3
        try:
            for i in range(10, 16):
                coord._remember_owners([_job(i, "root")])
            assert list(coord._owners) == ["13", "14", "15"]
        finally:
            daemon_mod.MAX_OWNERS = old
    finally:
        coord.close()
    with pytest.raises(qc.CoordinatorUnreachable):
        qc.jobs(endpoint, timeout_s=0.5)


def test_a_coordinator_whose_query_port_is_taken_still_starts(munged, tmp_path, caplog):
    from slurm_antman.coordinator.daemon import Coordinator
    from slurm_antman.slurm import CliBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        coord = Coordinator(_cfg(query_endpoint=endpoint, audit_log=str(tmp_path / "audit.jsonl")),
                            backend=CliBackend(env={"PATH": str(tmp_path)}, timeout=5))
        coord.start()
        try:
            assert coord.query is None
            assert f"cannot bind the query endpoint {endpoint}" in caplog.text
            assert coord.run_cycle() == []  # it decides (here: finds no Slurm) as ever
        finally:
            coord.close()


# --- antman explain as antman-dev ------------------------------------------------------------------

@pytest.fixture
def explain_site(munged, dev_user, tmp_path):
    """A query server over a root-only audit log, and the antman.yaml users read (tmp_path is
    antman-dev's: tests/conftest.py)."""
    audit_log = tmp_path / "audit.jsonl"
    recs = [{"ts": 1.7e9, "kind": "upgrade", "job_id": "7", "user": "root", "reason": "quota freed", "inputs": {},
             "params": {}, "outcome": "ok"},
            {"ts": 1.7e9 + 5, "kind": "paused", "job_id": "8", "node": "n1", "user": DEV_USER, "params": {},
             "reason": "GPU 0: guaranteed demand leaves too little", "outcome": "ok"}]
    audit_log.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs))
    audit_log.chmod(0o600)
    srv = q.QueryServer("tcp://127.0.0.1:*", lambda v: q.QueryHandler(v, str(audit_log)))
    srv.start()
    srv.publish(q.QueryView(reports=MappingProxyType({}), owners=MappingProxyType({"7": "root", "8": DEV_USER})))
    conf = tmp_path / "antman.yaml"
    conf.write_text(yaml.safe_dump({"nodes": NODES, "coordinator": {"query_endpoint": srv.endpoint,
                                                                    "audit_log": str(audit_log)}}))
    conf.chmod(0o644)
    yield conf, srv.endpoint
    srv.stop()


def _explain_as_dev(conf, *args: str):
    return as_user(sys.executable, "-m", "slurm_antman.cli", "explain", *args, env={"ANTMAN_CONFIG": str(conf)})


def test_explain_as_a_user_tells_their_own_jobs_story_through_the_coordinator(explain_site):
    conf, endpoint = explain_site
    r = _explain_as_dev(conf, "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("job 8: 1 coordinator record(s)") and "paused in place on n1" in r.stdout
    assert "why: GPU 0: guaranteed demand leaves too little" in r.stdout and r.stderr == ""
    r = _explain_as_dev(conf, "8", "--json")
    doc = json.loads(r.stdout)
    assert doc["via"] == endpoint and doc["owner"] == DEV_USER and [x["kind"] for x in doc["pauses"]] == ["paused"]


def test_explain_of_another_users_job_is_one_line(explain_site):
    conf, _ = explain_site
    r = _explain_as_dev(conf, "7")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == "job 7 is not yours: only its owner and admins see its story\n"


def test_explain_with_no_coordinator_is_one_line_naming_it(munged, dev_user, tmp_path):
    port = _free_port()
    conf = tmp_path / "antman.yaml"
    conf.write_text(yaml.safe_dump({"nodes": NODES, "coordinator": {
        "query_endpoint": f"tcp://127.0.0.1:{port}", "audit_log": str(tmp_path / "absent.jsonl")}}))
    conf.chmod(0o644)
    r = _explain_as_dev(conf, "8")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr == (f"antman explain: the coordinator does not answer at tcp://127.0.0.1:{port} "
                        "(connection refused)\n")


def test_explain_as_root_reads_a_readable_audit_log_without_the_coordinator(tmp_path):
    from slurm_antman.coordinator import explain

    audit_log = tmp_path / "audit.jsonl"
    audit_log.write_text(json.dumps({"ts": 1.7e9, "kind": "upgrade", "job_id": "7", "reason": "quota freed",
                                     "inputs": {}, "params": {}, "outcome": "ok"}) + "\n")
    conf = tmp_path / "antman.yaml"
    conf.write_text(yaml.safe_dump({"nodes": NODES, "coordinator": {
        "query_endpoint": f"tcp://127.0.0.1:{_free_port()}", "audit_log": str(audit_log)}}))
    import argparse

    assert os.access(audit_log, os.R_OK)
    assert explain.run(argparse.Namespace(job_id="7", json=False, config=str(conf), audit_log=None)) == 0
