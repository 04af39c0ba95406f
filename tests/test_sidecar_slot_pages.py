"""Idle-slot pages, the sidecar's side (slurm_antman/sidecar/slot_pages.py): the ACL's
bytes, which GPU gets a page and which agent what role, the directory and file rules root keeps, the
permissions as real unprivileged users see them, and the sidecar offering pages over its agent sockets."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pwd
import shutil
import stat
import struct
import subprocess
import tempfile
import time

import pytest

from slurm_antman import protocol as p
from slurm_antman.clients import sidecar_control as client
from slurm_antman.policy.node.core import GiB
from slurm_antman.protocol import slot_page
from slurm_antman.sidecar import slot_pages as sp
from slurm_antman.sidecar.records import AgentConnection, RegisteredJob
from test_munge import DEV_USER
from test_sidecar_daemon import NOBODY, Running, SimAgent, make_config, sockdir, wait_for  # noqa: F401 - fixture

U = sp.ACL_UNDEFINED_ID
UNRELATED = 4242  # a uid no job here runs as
SYSTEM_PY = next((x for x in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(x, os.X_OK)), None)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="ownership and other users' access need root")


def _dev_uid() -> int:
    try:
        return pwd.getpwnam(DEV_USER).pw_uid
    except KeyError:
        return 4343  # the sidecar's rules need no passwd entry; only the as-a-user checks do


def _acl_entries(raw: bytes) -> list[tuple[int, int, int]]:
    assert (len(raw) - 4) % 8 == 0
    assert struct.unpack_from("<I", raw)[0] == 2
    return [struct.unpack_from("<HHI", raw, 4 + 8 * i) for i in range((len(raw) - 4) // 8)]


# --- the ACL -----------------------------------------------------------------------------------------

def test_page_acl_is_owner_rw_each_reader_r_and_nobody_else_sorted_by_tag_then_id():
    assert _acl_entries(sp.page_acl([1001, 5, 1001])) == [
        (0x01, 6, U), (0x02, 4, 5), (0x02, 4, 1001), (0x04, 0, U), (0x10, 4, U), (0x20, 0, U)]
    assert _acl_entries(sp.page_acl([])) == [(0x01, 6, U), (0x04, 0, U), (0x10, 4, U), (0x20, 0, U)]
    for bad in (-1, U):
        with pytest.raises(ValueError, match="cannot be named"):
            sp.page_acl([bad])


def test_the_kernel_takes_the_acl_as_it_is_and_shows_it_in_the_mode():
    # The bytes are the kernel's format: it refuses a malformed ACL (EINVAL) rather than store it.
    fd, path = tempfile.mkstemp(dir="/tmp")
    try:
        os.setxattr(fd, sp.ACL_XATTR, sp.page_acl([1001, 7]))
        assert _acl_entries(os.getxattr(fd, sp.ACL_XATTR)) == _acl_entries(sp.page_acl([7, 1001]))
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o640  # group bits show the mask
        out_of_order = sp.page_acl([1001, 7])[:4] + b"".join(
            struct.pack("<HHI", *e) for e in [(0x01, 6, U), (0x04, 0, U), (0x02, 4, 7), (0x10, 4, U), (0x20, 0, U)])
        with pytest.raises(OSError) as ei:
            os.setxattr(fd, sp.ACL_XATTR, out_of_order)
        assert ei.value.errno == errno.EINVAL
    finally:
        os.close(fd)
        os.unlink(path)


# --- which GPU gets a page, which agent which role (pure) ------------------------------------------

def _job(job_id: str, cls: str, uid: int, gpus, agents=()) -> RegisteredJob:
    """``agents``: (GPU, features) per agent, in registration order."""
    j = RegisteredJob(job_id, cls, uid, None, "u", list(gpus), "requested", "", 0.0)
    for i, (gpu, feats) in enumerate(agents):
        reg = p.Register(job_id=job_id, pid=100 + i, rank=i, local_rank=i, world_size=len(agents), hostname="n1",
                         agent_version="t", torch_version="t", device="cuda", job_class=cls, features=feats)
        ident = f"{job_id}-{i}".encode()
        j.agents[ident] = AgentConnection(ident, reg, gpu, 0.0, 0.0)
    return j


SLOTS = (p.FEATURE_SLOTS,)


def test_a_page_needs_one_guaranteed_job_publishing_on_the_gpu_and_an_opportunistic_one():
    g = _job("1", "guaranteed", 500, [0, 1], [(0, SLOTS), (1, ())])
    o = _job("2", "opportunistic", 600, [0], [(0, ())])
    o2 = _job("3", "opportunistic", 700, [0, 1], [(0, SLOTS), (1, SLOTS)])
    same_user = _job("4", "opportunistic", 500, [0], [(0, SLOTS)])
    want = sp.wanted_pages([g, o, o2, same_user])
    # GPU 1: the guaranteed job's agent there cannot publish. The owner needs no reader entry.
    assert want == {0: sp.PageWant("1", b"1-0", 500, frozenset({600, 700}))}
    assert sp.wanted_pages([g]) == {}                                              # nobody to fill
    assert sp.wanted_pages([_job("1", "guaranteed", 500, [0], [(0, ())]), o]) == {}  # nobody publishes
    assert sp.wanted_pages([_job("1", "guaranteed", 500, [0]), o]) == {}             # no agent yet
    two = _job("5", "guaranteed", 800, [0], [(0, SLOTS)])
    assert sp.wanted_pages([g, two, o]) == {}  # two guaranteed jobs on a GPU: whose idle time is it?


def test_one_writer_per_page_and_only_agents_that_declared_the_feature_hear_of_it():
    g = _job("1", "guaranteed", 500, [0], [(0, SLOTS), (0, SLOTS)])
    o = _job("2", "opportunistic", 600, [0], [(0, SLOTS), (0, ())])
    want = sp.wanted_pages([g, o])
    assert want[0].writer == b"1-0"  # the first registered
    page = sp.Page(0, "/run/x/slots/gpu0.slots", "1", want[0].writer, 500, want[0].readers, -1, 7)
    pages = {0: page}
    a0, a1 = g.agents.values()
    f0, f1 = o.agents.values()
    assert sp.slot_of(g, a0, pages) == (page.path, "publish", 7)
    assert sp.slot_of(g, a1, pages) is None
    assert sp.slot_of(o, f0, pages) == (page.path, "fill", 7)
    assert sp.slot_of(o, f1, pages) is None
    assert sp.slot_of(o, f0, {}) is None


# --- the directory and the files, as root keeps them ---------------------------------------------

@pytest.fixture
def root_dir():
    d = tempfile.mkdtemp(prefix="am-slots-", dir="/tmp")
    os.chmod(d, 0o755)  # as the sidecar's socket directory: others may traverse it
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _want(owner=NOBODY, readers=(), publisher="100", writer=b"w"):
    return sp.PageWant(publisher, writer, owner, frozenset(readers))


@needs_root
def test_a_page_is_a_fresh_page_file_owned_by_the_guaranteed_uid_with_the_acl(root_dir):
    pages = sp.SlotPages(root_dir)
    try:
        pages.sync({0: _want(readers={1001})})
        d = os.path.join(root_dir, "slots")
        dst = os.lstat(d)
        assert stat.S_ISDIR(dst.st_mode) and (dst.st_uid, stat.S_IMODE(dst.st_mode)) == (0, 0o755)
        path = os.path.join(d, "gpu0.slots")
        assert pages.pages[0].path == path
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_size == slot_page.PAGE_BYTES
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0, 0o640)
        assert os.getxattr(path, sp.ACL_XATTR) == sp.page_acl([1001])
        r = slot_page.SlotReader(path)
        assert r.read().state == slot_page.NONE
        r.close()
        # Readers come and go: the ACL follows, the file stays the same.
        pages.sync({0: _want(readers={1001, 1002})})
        assert os.getxattr(path, sp.ACL_XATTR) == sp.page_acl([1001, 1002])
        assert os.lstat(path).st_ino == st.st_ino
        # A new guaranteed job (or writer) gets a new file, the old one unlinked under whoever holds it.
        held = os.open(path, os.O_RDONLY)
        try:
            gen = pages.pages[0].generation
            pages.sync({0: _want(readers={1001}, publisher="101")})
            assert os.fstat(held).st_nlink == 0 and not os.path.samestat(os.fstat(held), os.lstat(path))
            assert pages.pages[0].generation > gen
        finally:
            os.close(held)
        pages.sync({})
        assert os.listdir(d) == [] and pages.pages == {}
    finally:
        pages.close()


@needs_root
def test_a_symlinked_or_foreign_slots_directory_is_refused(root_dir, tmp_path):
    elsewhere = tempfile.mkdtemp(dir="/tmp")
    try:
        os.symlink(elsewhere, os.path.join(root_dir, "slots"))
        pages = sp.SlotPages(root_dir)
        pages.sync({0: _want()})
        assert pages.pages == {} and os.listdir(elsewhere) == []
        with pytest.raises(sp.SlotDirError, match="not a directory this sidecar made"):
            pages.clear_stale()
        os.unlink(os.path.join(root_dir, "slots"))
        os.mkdir(os.path.join(root_dir, "slots"))
        os.chown(os.path.join(root_dir, "slots"), 1001, 1001)  # a user's directory: they could swap entries
        pages = sp.SlotPages(root_dir)
        pages.sync({0: _want()})
        assert pages.pages == {} and os.listdir(os.path.join(root_dir, "slots")) == []
        with pytest.raises(sp.SlotDirError, match="owned by uid 1001"):
            pages.clear_stale()
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


@needs_root
def test_a_planted_link_or_a_leftover_page_is_replaced_never_followed(root_dir, tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"root's")
    os.chmod(target, 0o600)
    d = os.path.join(root_dir, "slots")
    os.mkdir(d, 0o755)
    os.symlink(target, os.path.join(d, "gpu0.slots"))
    with open(os.path.join(d, "gpu1.slots"), "wb") as f:  # a previous sidecar's
        f.write(b"x" * 4096)
    with open(os.path.join(d, "notes"), "wb") as f:
        f.write(b"not a page")
    pages = sp.SlotPages(root_dir)
    try:
        pages.clear_stale()
        assert sorted(os.listdir(d)) == ["notes"]  # only page names are the sidecar's to remove
        os.symlink(target, os.path.join(d, "gpu0.slots"))
        pages.sync({0: _want()})
        st = os.stat(target)
        assert target.read_bytes() == b"root's" and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
        assert stat.S_ISREG(os.lstat(os.path.join(d, "gpu0.slots")).st_mode)
    finally:
        pages.close()
    assert sorted(os.listdir(d)) == ["notes"]  # a stopping sidecar takes its pages with it


def test_a_file_system_without_acls_gets_no_page_rather_than_a_wider_one(root_dir, monkeypatch, caplog):
    def no_acls(*a, **kw):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(sp.os, "setxattr", no_acls)
    pages = sp.SlotPages(root_dir)
    try:
        with caplog.at_level(logging.ERROR, logger="antman.sidecar"):
            pages.sync({0: _want(owner=os.geteuid()), 1: _want(owner=os.geteuid())})
            pages.sync({0: _want(owner=os.geteuid())})
        assert pages.pages == {} and "no POSIX ACLs" in pages.refused
        assert os.listdir(os.path.join(root_dir, "slots")) == []
        assert len([r for r in caplog.records if "no idle-slot pages" in r.getMessage()]) == 1
    finally:
        pages.close()


# --- as real users --------------------------------------------------------------------------------

PROBE = r"""
import sys
out = []
for mode in ("rb", "r+b"):
    try:
        with open(sys.argv[1], mode) as f:
            out.append(f.read(8).hex())
    except PermissionError:
        out.append("denied")
print(" ".join(out))
"""


def _as(uid: int, path: str) -> list[str]:
    r = subprocess.run([SYSTEM_PY, "-c", PROBE, path], capture_output=True, text=True, timeout=30, cwd="/",
                       user=uid, group=uid, extra_groups=[])
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@needs_root
def test_the_gpus_opportunistic_users_read_the_page_its_owner_writes_it_nobody_else_opens_it(root_dir):
    try:
        dev = pwd.getpwnam(DEV_USER).pw_uid
    except KeyError:
        pytest.skip(f"no user {DEV_USER} on this host (`antman devcluster up` makes it)")
    if SYSTEM_PY is None:
        pytest.skip("no system python3 an unprivileged user can run")
    magic = slot_page.MAGIC.to_bytes(8, "little").hex()
    pages = sp.SlotPages(root_dir)
    try:
        pages.sync({0: _want(owner=NOBODY, readers={dev})})
        path = pages.pages[0].path
        assert _as(dev, path) == [magic, "denied"]       # the opportunistic job's user: read only
        assert _as(NOBODY, path) == [magic, magic]       # the guaranteed job's user: its writer
        assert _as(UNRELATED, path) == ["denied", "denied"]
        pages.sync({0: _want(owner=NOBODY, readers=())})  # the opportunistic job left
        assert _as(dev, path) == ["denied", "denied"]
    finally:
        pages.close()


# --- the sidecar offering pages --------------------------------------------------------------------

def _raw_bodies(agent: SimAgent, want: str, timeout_s: float = 5.0, until=lambda b: True) -> dict:
    """The first ``want`` body that satisfies ``until``, as the JSON on the wire (what an older agent
    would have to decode)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {want!r} within {timeout_s} s"
        if agent.sock.poll(int(left * 1000)):
            frames = agent.sock.recv_multipart()
            env = json.loads(frames[1])
            p.decode(frames, p.SIDECAR_TO_AGENT)  # and valid
            if env["type"] == want and until(env["body"]):
                return env["body"]


def _register_raw(agent: SimAgent) -> dict:
    agent.send(p.Register(job_id=agent.job_id, pid=agent.pid, rank=agent.rank, local_rank=agent.rank,
                          world_size=1, hostname="n1", agent_version="sim", torch_version="none", device="cuda",
                          job_class=agent.job_class, features=agent.features))
    return _raw_bodies(agent, "registered")


def _two_jobs(sockdir, guaranteed_features, opportunistic_features):
    """Guaranteed job 100 (uid nobody) on GPU 0 with one agent, reporting; opportunistic job 200 (the dev
    user's uid) placed beside it, with one agent. Returns both agents, the registered bodies and the uid."""
    dev = _dev_uid()
    g = client.register_job(sockdir, "100", uid=NOBODY, user="nobody", job_class="guaranteed", gpus=1,
                            physical_gpus=[0])
    ga = SimAgent(g.endpoint, "100", "guaranteed", features=guaranteed_features)
    greg = _register_raw(ga)
    ga.report(100.0, 2 * GiB)
    o = client.register_job(sockdir, "200", uid=dev, user="dev", job_class="opportunistic", gpus=1)
    assert o.gpus == [0]
    oa = SimAgent(o.endpoint, "200", features=opportunistic_features)
    return ga, oa, greg, _register_raw(oa), dev


@needs_root
def test_a_publishing_guaranteed_agent_and_a_filling_neighbour_get_the_page_until_the_guaranteed_job_goes(sockdir):
    r = Running(sockdir, make_config(gpus=1, slot_filling=True))
    agents = []
    try:
        ga, oa, greg, oreg, dev = _two_jobs(sockdir, SLOTS, SLOTS)
        agents += [ga, oa]
        page = os.path.join(sockdir, "slots", "gpu0.slots")
        assert "slot_page" not in greg  # alone on its GPU: nobody to fill its slots
        assert (oreg["slot_page"], oreg["slot_role"]) == (page, "fill")
        lim = _raw_bodies(ga, "limits", until=lambda b: "slot_page" in b)
        assert (lim["slot_page"], lim["slot_role"]) == (page, "publish")
        assert lim["mem_limit_bytes"] is None and lim["compute_share"] == 1.0
        st = os.lstat(page)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o640)
        assert os.getxattr(page, sp.ACL_XATTR) == sp.page_acl([dev])
        # The guaranteed job's agent writes it, through the path it was given.
        w = slot_page.SlotWriter(lim["slot_page"])
        w.busy()
        rd = slot_page.SlotReader(oreg["slot_page"])
        assert rd.read().state == slot_page.BUSY
        rd.close()
        w.close()
        # A second agent of the opportunistic job, of before the feature: never a slot field on its wire.
        old = SimAgent(p.ipc(p.agent_path(sockdir, "200")), "200", rank=1)
        agents.append(old)
        oldreg = _register_raw(old)
        assert "slot_page" not in oldreg and "slot_role" not in oldreg and oldreg["job_class"] == "opportunistic"
        # The guaranteed job leaves: its page goes, and the neighbour is told (limits without a page).
        assert client.retire_job(sockdir, "100") is True
        wait_for(lambda: not os.path.exists(page), what="the page removed")
        body = _raw_bodies(oa, "limits")
        assert "slot_page" not in body and p.decode(
            [p.MARKER, json.dumps({"v": 1, "type": "limits", "id": "x", "ts": 0, "ref": None, "body": body}).encode()]
        ).body.slot_page is None
        assert "slot_page" not in _raw_bodies(old, "limits")  # the same seq as oa's, and no page field
    finally:
        for a in agents:
            a.close()
        r.stop()


@needs_root
@pytest.mark.parametrize("slot_filling,guaranteed_features", [(False, SLOTS), (True, ())],
                         ids=["slot_filling off", "guaranteed agent without the feature"])
def test_no_page_when_slot_filling_is_off_or_the_guaranteed_agent_cannot_publish(sockdir, slot_filling,
                                                                                   guaranteed_features):
    r = Running(sockdir, make_config(gpus=1, slot_filling=slot_filling))
    agents = []
    try:
        ga, oa, greg, oreg, _ = _two_jobs(sockdir, guaranteed_features, SLOTS)
        agents += [ga, oa]
        assert "slot_page" not in greg and "slot_page" not in oreg
        time.sleep(0.5)  # several ticks: nothing comes later either
        assert "limits" not in ga.drain_types()
        slots = os.path.join(sockdir, "slots")
        assert not os.path.exists(slots) or os.listdir(slots) == []
    finally:
        for a in agents:
            a.close()
        r.stop()


@needs_root
def test_turning_slot_filling_off_by_a_reload_removes_the_page_and_tells_both_agents(sockdir):
    r = Running(sockdir, make_config(gpus=1, slot_filling=True))
    agents = []
    try:
        ga, oa, _, oreg, _ = _two_jobs(sockdir, SLOTS, SLOTS)
        agents += [ga, oa]
        page = oreg["slot_page"]
        assert os.path.exists(page)
        _raw_bodies(ga, "limits", until=lambda b: "slot_page" in b)
        r.sidecar.reloader = lambda current: dataclasses.replace(current, slot_filling=False)
        r.sidecar.request_reload()
        wait_for(lambda: not os.path.exists(page), what="the page removed")
        for a in (ga, oa):
            assert "slot_page" not in _raw_bodies(a, "limits")
    finally:
        for a in agents:
            a.close()
        r.stop()
