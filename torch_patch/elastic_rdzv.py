"""Task 0's rendezvous file, for the launcher across nodes (torch_patch/elastic_nodes.py): where the
array's other tasks find the c10d store that task 0's torchrun hosts.

``DIR/.antman-rdzv.<ARRAY_JOB_ID>.json`` holds ``{"addr": str, "port": int, "job_id": str, "array_job_id":
str, "restart": int, "time": float}``: task 0's address and store port, its ``SLURM_JOB_ID``, the
array's id, its ``SLURM_RESTART_COUNT`` and when it was written. Task 0 writes it atomically (a
temporary file made with O_EXCL and mode 0600 beside it, then a rename) and removes it at exit. A
reader opens it with O_NOFOLLOW and takes only a regular file of its own uid, at most 4096 bytes,
with exactly those fields, each of its type and range, and this array's id: the file is the job's own
data, in a directory the job's user writes, and nothing else reads it.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import socket
import stat
import tempfile
from typing import Optional

from slurm_antman import protocol as P

MAX_FILE_BYTES = 4096
FILE_KEYS = frozenset(("addr", "port", "job_id", "array_job_id", "restart", "time"))
PROBE_TIMEOUT_S = 2.0
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*$")


class Refused(Exception):
    """A setup or rendezvous-file problem: one line, and the task ends (exit ``code``)."""

    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code


def valid_addr(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(addr))


def rdzv_path(directory: str, array_job_id: str) -> str:
    return os.path.join(directory, f".antman-rdzv.{array_job_id}.json")


def parse_rdzv(data: bytes, array_job_id: str) -> dict:
    """Task 0's endpoint, every field checked; Refused otherwise."""
    if len(data) > MAX_FILE_BYTES:
        raise Refused(f"over {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise Refused(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or set(doc) != FILE_KEYS:
        raise Refused(f"expected an object with exactly {', '.join(sorted(FILE_KEYS))}")
    addr, port, restart, when = doc["addr"], doc["port"], doc["restart"], doc["time"]
    if not isinstance(addr, str) or not valid_addr(addr):
        raise Refused(f"addr {addr!r}: expected an IP address or a host name")
    if type(port) is not int or not 1 <= port <= 65535:
        raise Refused(f"port {port!r}: expected an integer from 1 to 65535")
    for key in ("job_id", "array_job_id"):
        if not isinstance(doc[key], str) or not P.JOB_ID_RE.match(doc[key]):
            raise Refused(f"{key} {doc[key]!r}: expected a Slurm job id (a string of digits)")
    if doc["array_job_id"] != array_job_id:
        raise Refused(f"array_job_id {doc['array_job_id']!r}: this task is of array {array_job_id}")
    if type(restart) is not int or not 0 <= restart < 2 ** 31:
        raise Refused(f"restart {restart!r}: expected an integer >= 0")
    if type(when) not in (int, float) or not math.isfinite(when) or when <= 0:
        raise Refused(f"time {when!r}: expected seconds since the epoch")
    return doc


def read_rdzv(path: str, array_job_id: str) -> Optional[dict]:
    """The file's endpoint; None when there is no file yet. Never follows a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Refused(f"rendezvous file {path}: {'a symbolic link' if os.path.islink(path) else e.strerror}; "
                      "refused") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise Refused(f"rendezvous file {path}: not a regular file of uid {os.getuid()}; refused")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return parse_rdzv(data, array_job_id)
    except Refused as e:
        raise Refused(f"rendezvous file {path}: {e}; refused") from None


def write_rdzv(path: str, doc: dict) -> os.stat_result:
    """Atomically: a private temporary file (O_EXCL, mode 0600) beside it, then a rename."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, separators=(",", ":")) + "\n")
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return os.stat(path, follow_symlinks=False)


def free_port() -> int:
    """A port nobody listens on now (on any address); torchrun's store binds it moments later."""
    dual = socket.has_dualstack_ipv6()
    with socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual) as s:
        return s.getsockname()[1]


def answers(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def endpoint(doc: dict) -> str:
    addr = doc["addr"]
    return f"[{addr}]:{doc['port']}" if ":" in addr else f"{addr}:{doc['port']}"
