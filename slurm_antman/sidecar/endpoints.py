"""The sidecar's socket directory and its permissions.

    SOCKET_DIR/               0755 root   (users must traverse it to reach their job's socket)
    SOCKET_DIR/control.sock   0600 root   (Prolog, Epilog, CLI run as root)
    SOCKET_DIR/sidecar.lock   0600 root   (flock: one sidecar per directory)
    SOCKET_DIR/state/         0700 root   (job registrations, so a restarted sidecar rebinds them;
                                           not in the job's directory, where its user could forge one)
    SOCKET_DIR/jobs/          0711 root   (traversable, not listable: users cannot see other jobs)
    SOCKET_DIR/jobs/JOBID/    0711 root   (root's: the job's user must not be able to swap what root
                                           chmods and chowns in it, e.g. agent.sock for a symlink)
        agent.sock            0600 uid    (only the job's user and root can connect)
    SOCKET_DIR/slots/         0755 root   (sidecar.slot_filling only; slot_pages.py makes and checks it)
        gpuN.slots            0640+ACL    (owner: GPU N's guaranteed job's uid, rw; its opportunistic
                                           jobs' uids r; nobody else)
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
from typing import Optional

from slurm_antman import protocol
from slurm_antman.errors import AntmanError

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


class SocketDirError(AntmanError, RuntimeError):
    """The socket directory cannot be made, locked or bound in. Still a RuntimeError, as it was before
    it derived from AntmanError, so no caller's ``except RuntimeError`` changes meaning."""


def _ensure_dir(path: str, mode: int, uid: int = 0, gid: int = -1) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SocketDirError(f"cannot create {path}: {e.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"{path} exists and is not a directory")
    os.chmod(path, mode)
    if os.geteuid() == 0:
        os.chown(path, uid, gid)


def check_socket_path(path: str) -> None:
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise SocketDirError(f"socket path {path} is {len(path.encode())} bytes; Unix sockets allow "
                             f"{MAX_SOCKET_PATH}: choose a shorter --socket-dir")


class SocketDir:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self._lock_fd: Optional[int] = None

    @property
    def control_path(self) -> str:
        return protocol.control_path(self.root)

    def job_dir(self, job_id: str) -> str:
        return protocol.job_dir(self.root, job_id)

    def agent_path(self, job_id: str) -> str:
        return protocol.agent_path(self.root, job_id)

    @property
    def state_dir(self) -> str:
        """Where the job records a restarted sidecar reads live."""
        return os.path.join(self.root, "state")

    def _state_file(self, job_id: str) -> str:
        protocol.job_dir(self.root, job_id)  # validates the id
        return os.path.join(self.state_dir, f"{job_id}.json")

    def prepare(self) -> None:
        """Create the tree and take the directory's lock (a second sidecar here fails clearly)."""
        _ensure_dir(self.root, 0o755)
        _ensure_dir(os.path.join(self.root, "jobs"), 0o711)
        _ensure_dir(self.state_dir, 0o700)
        check_socket_path(self.control_path)
        fd = os.open(os.path.join(self.root, "sidecar.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SocketDirError(f"another sidecar is running on {self.root} (lock held on sidecar.lock)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def secure_control(self) -> None:
        os.chmod(self.control_path, 0o600)

    def make_job_dir(self, job_id: str, uid: int, gid: Optional[int]) -> str:
        """The job's directory, root-owned (an older sidecar made it the user's: taken back), with no
        agent.sock left in it: the socket is bound afresh, never a leftover the user may have planted."""
        path = self.job_dir(job_id)
        _ensure_dir(path, 0o711)
        sock = self.agent_path(job_id)
        check_socket_path(sock)
        try:
            os.unlink(sock)  # never follows a link: removes the entry itself
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(sock)
        return sock

    def secure_agent_socket(self, job_id: str, uid: int, gid: Optional[int]) -> None:
        """Give the bound socket to the job's user. Its directory is root's, so between the checks
        and the changes below nobody but root can replace it; the checks catch anything else."""
        sock = self.agent_path(job_id)
        st = os.lstat(sock)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise SocketDirError(f"{sock} is not the socket this sidecar bound; not changing it")
        os.chmod(sock, 0o600)
        if os.geteuid() == 0:
            os.chown(sock, uid, -1 if gid is None else gid, follow_symlinks=False)

    def remove_job(self, job_id: str) -> None:
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
        try:
            os.unlink(self._state_file(job_id))
        except FileNotFoundError:
            pass

    def save_job(self, job_id: str, record: dict) -> None:
        path = self._state_file(job_id)
        tmp = f"{path}.tmp"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except OSError:
            # A full disk leaves a partial temp file; never leave it to take the space a retry needs.
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def saved_jobs(self) -> list[dict]:
        out = []
        d = self.state_dir
        for name in sorted(os.listdir(d)):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(d, name)) as f:
                    rec = json.load(f)
                if isinstance(rec, dict):
                    out.append(rec)
            except (OSError, ValueError):
                continue
        return out

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
