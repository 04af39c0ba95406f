"""The job's node-local env file, ``STATE_DIR/NODE/jobs/JOBID.env``: its path and its format.

The Prolog writes it; the SPANK plugin (spank/envfile.c) reads it as root in slurmstepd and puts
every entry into each task's environment. This module is the one Python side of that contract, so
its limits mirror what envfile.c accepts: a writer that stays inside them is read back exactly, and
``parse_env`` returns what the plugin would apply.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Mapping

from .errors import AntmanError

# envfile.c's key_is_valid: the plugin skips any other line, so a writer must never produce one.
KEY_PATTERN = r"[A-Z_][A-Z0-9_]*"
KEY_RE = re.compile(KEY_PATTERN)
# A newline would end the entry early (and could smuggle in another key); a NUL makes the plugin skip the line.
FORBIDDEN_VALUE_CHARS = ("\n", "\0")
# ENV_FILE_MAX_BYTES: a bigger file is not applied at all.
MAX_BYTES = 64 * 1024
# ENV_FILE_MAX_ENTRIES: entries past this are dropped.
MAX_ENTRIES = 256
COMMENT_PREFIX = "#"
# nodename_is_safe: the plugin only looks in node directories with such names (no dot first, so no "..").
NODE_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
# The plugin refuses a file that is group or world writable, or owned by anyone but root or SlurmdUser.
FILE_MODE = 0o644

_HEADER = f"{COMMENT_PREFIX} written by `antman node prolog`; applied to every task by the SPANK plugin\n"


class EnvFileError(AntmanError, ValueError):
    """Values the SPANK plugin would not read back as written, or a file it would not apply."""


def path(state_dir: str | os.PathLike[str], node: str, job_id: str | int) -> Path:
    """Where the plugin looks for this job's file on this node (envfile.c's env_file_path). A node name
    or job id the plugin would never look under is refused: root writes here, so the path must not be
    able to leave STATE_DIR."""
    if not NODE_NAME_RE.fullmatch(node):
        raise EnvFileError(f"node name {node!r} does not match {NODE_NAME_RE.pattern}")
    if not str(job_id).isdigit():
        raise EnvFileError(f"job id {job_id!r} is not a number")
    return Path(state_dir) / node / "jobs" / f"{job_id}.env"


def format_env(values: Mapping[str, str]) -> bytes:
    """The file's bytes, one ``KEY=VALUE`` line per entry in the mapping's order. Raises
    ``EnvFileError`` for anything the plugin would skip, cut short or refuse."""
    if len(values) > MAX_ENTRIES:
        raise EnvFileError(f"{len(values)} env entries; the SPANK plugin reads at most {MAX_ENTRIES}")
    lines = [_HEADER]
    for k, v in values.items():
        if not KEY_RE.fullmatch(k):
            raise EnvFileError(f"env key {k!r} does not match {KEY_PATTERN}")
        for c in FORBIDDEN_VALUE_CHARS:
            if c in v:
                raise EnvFileError(f"env value for {k} contains a {'newline' if c == chr(10) else 'NUL byte'}")
        lines.append(f"{k}={v}\n")
    data = "".join(lines).encode()
    if len(data) > MAX_BYTES:
        raise EnvFileError(f"env file of {len(data)} bytes; the SPANK plugin applies none over {MAX_BYTES}")
    return data


def parse_env(data: bytes) -> dict[str, str]:
    """What the plugin puts into a task's environment from these bytes: comments, blank lines, lines
    with a NUL or without a valid key are skipped, entries past ``MAX_ENTRIES`` dropped, and a later
    duplicate wins (the plugin sets each in file order, overwriting). A file over ``MAX_BYTES`` is
    not applied at all: ``EnvFileError``. Bytes that are not UTF-8 survive as surrogate escapes."""
    if len(data) > MAX_BYTES:
        raise EnvFileError(f"env file of {len(data)} bytes; the SPANK plugin applies none over {MAX_BYTES}")
    out: dict[str, str] = {}
    entries = 0
    # getline splits on "\n" alone: a "\r" stays in the value, as it does in the task's environment.
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for raw in lines:
        if b"\0" in raw or raw.startswith(COMMENT_PREFIX.encode()) or raw.isspace() or not raw:
            continue
        key, eq, value = raw.partition(b"=")
        if not eq or not KEY_RE.fullmatch(key.decode("ascii", "replace")):
            continue
        if entries == MAX_ENTRIES:
            break
        entries += 1
        out[key.decode("ascii")] = value.decode("utf-8", "surrogateescape")
    return out


def write(file: str | os.PathLike[str], values: Mapping[str, str]) -> None:
    """Replace the file atomically: the plugin may read it at any moment, and must never see half of it."""
    file = Path(file)
    data = format_env(values)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full disk must not keep the partial file's space
        raise
