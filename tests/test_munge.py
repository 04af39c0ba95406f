"""slurm_antman.munge against the host's real munged: a credential says who made it (root, or the
unprivileged antman-dev through runuser), and munged refuses one replayed, expired or forged."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_antman import munge
from slurm_antman.errors import AntmanError

REPO = Path(__file__).resolve().parent.parent
DEV_USER = "antman-dev"  # devcluster.DEV_USER: made by the devcluster, or by `useradd` by hand


def _munge_answers() -> bool:
    try:
        munge.decode(munge.encode(b"probe"))
        return True
    except munge.MungeUnavailable:
        return False


@pytest.fixture(scope="session")
def munged() -> None:
    """The host's munged; started as the devcluster starts it when none answers (root only)."""
    if _munge_answers():
        return
    if os.geteuid() != 0 or not Path("/usr/sbin/munged").exists():
        pytest.fail("no munged answers on this host: start one (as root: mkdir -p /run/munge && "
                    "chown munge: /run/munge && runuser -u munge -- /usr/sbin/munged)")
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    r = subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], capture_output=True, text=True)
    deadline = time.monotonic() + 10
    while not _munge_answers():
        if time.monotonic() > deadline:
            pytest.fail(f"munged did not start: {r.stderr.strip()}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def dev_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("a credential of another uid needs runuser, which needs root")
    try:
        return pwd.getpwnam(DEV_USER)
    except KeyError:
        pytest.skip(f"no user {DEV_USER} on this host (`antman devcluster up` makes it): no credential of a "
                    "non-root uid can be had")


def as_user(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``argv`` run as antman-dev, with this checkout importable and ``env`` added."""
    extra = [f"{k}={v}" for k, v in {"PYTHONPATH": str(REPO), **(env or {})}.items()]
    return subprocess.run(["runuser", "-u", DEV_USER, "--", "env", *extra, *argv], cwd="/", capture_output=True,
                          text=True, timeout=timeout)


def as_user_python(code: str, **kw) -> subprocess.CompletedProcess:
    return as_user(sys.executable, "-c", code, **kw)


def test_a_credential_decodes_to_the_uid_and_gid_that_made_it(munged, dev_user):
    mine = munge.decode(munge.encode(b"root's request"))
    assert (mine.uid, mine.gid, mine.payload) == (0, 0, b"root's request")
    # munge(1) as antman-dev: the credential is munged's word, whoever decodes it.
    r = as_user("munge", "-s", "antman-dev's request")
    assert r.returncode == 0, r.stderr
    theirs = munge.decode(r.stdout.strip())
    assert (theirs.uid, theirs.gid, theirs.payload) == (dev_user.pw_uid, dev_user.pw_gid, b"antman-dev's request")
    # This module as antman-dev, as the antman CLI makes them.
    r = as_user_python("from slurm_antman import munge; print(munge.encode(bytes(range(256))))")
    assert r.returncode == 0, r.stderr
    assert munge.decode(r.stdout.strip()) == munge.Credential(dev_user.pw_uid, dev_user.pw_gid, bytes(range(256)))


def test_a_replayed_credential_is_refused(munged):
    cred = munge.encode(b"once")
    assert munge.decode(cred).payload == b"once"
    with pytest.raises(munge.CredentialReplayed) as e:
        munge.decode(cred)
    assert e.value.code == munge.EMUNGE_CRED_REPLAYED and "Replayed" in str(e.value)
    assert isinstance(e.value, munge.CredentialError) and isinstance(e.value, AntmanError)


def test_an_expired_credential_is_refused(munged):
    cred = munge.encode(b"soon stale", ttl=1)
    time.sleep(2.2)
    with pytest.raises(munge.CredentialExpired) as e:
        munge.decode(cred)
    assert e.value.code == munge.EMUNGE_CRED_EXPIRED


@pytest.mark.parametrize("bad", ["", "MUNGE:", "MUNGE:not base64!:", "x" * (munge.MAX_CREDENTIAL_CHARS + 1),
                                 "MUNGE:\u00e9:", "MUNGE:a\0b:"])
def test_garbage_is_a_credential_error(munged, bad):
    with pytest.raises(munge.CredentialError):
        munge.decode(bad)


def test_a_tampered_credential_is_refused(munged):
    cred = munge.encode(b"payload of forty bytes, give or take....")
    body = cred[len("MUNGE:"):-1]
    mid = len(body) // 2
    forged = "MUNGE:" + body[:mid] + ("A" if body[mid] != "A" else "B") + body[mid + 1:] + ":"
    with pytest.raises(munge.CredentialError) as e:
        munge.decode(forged)
    assert not isinstance(e.value, (munge.CredentialReplayed, munge.CredentialExpired))


def test_no_munged_is_munge_unavailable(tmp_path):
    with pytest.raises(munge.MungeUnavailable, match="munged does not answer"):
        munge.encode(b"x", socket=str(tmp_path / "no.socket"))
    with pytest.raises(munge.MungeUnavailable):
        munge.decode("MUNGE:AAAA:", socket=str(tmp_path / "no.socket"))
