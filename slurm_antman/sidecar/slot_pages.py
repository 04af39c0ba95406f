"""Idle-slot pages (docs/protocol.md, "The idle-slot page"): the sidecar's side.

On a GPU with a guaranteed job whose agent there can publish (``register.features`` has ``"slots"``)
and at least one opportunistic job, the sidecar makes ``SOCKET_DIR/slots/gpuN.slots``: a page
(``protocol.slot_page``) owned by the guaranteed job's uid, which its agent writes, and which the GPU's
opportunistic jobs' users may read through a POSIX ACL, nobody else. It tells the agents with the
feature which page is theirs and what to do with it (``registered`` / ``limits``: ``slot_page``,
``slot_role``), keeps the ACL in step with the GPU's opportunistic jobs, and removes the page when the
GPU stops qualifying: a new guaranteed job always gets a new file, never one a previous job could still
hold open for writing.

Everything here runs as root in a directory root owns, on paths it made itself: files are opened
relative to the directory's descriptor with ``O_NOFOLLOW``, created with ``O_EXCL``, and changed
through their own descriptors; the uids come from the Prolog's ``job_register``, never from an agent.
The sidecar never reads a page (the job writes it).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Iterable, Optional

from slurm_antman import protocol as p
from slurm_antman.protocol import slot_page
from slurm_antman.ratelimit import RateLimitedLog

from .records import AgentConnection, RegisteredJob

log = logging.getLogger("antman.sidecar")

SLOTS_DIR = "slots"
_PAGE_NAME = re.compile(r"^gpu[0-9]+\.slots$")

# The kernel's POSIX ACL as an extended attribute (linux/posix_acl_xattr.h): a little-endian u32
# version, then one (u16 tag, u16 perm, u32 id) per entry, sorted by tag, then id.
ACL_XATTR = "system.posix_acl_access"
ACL_VERSION = 2
ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK, ACL_OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
ACL_UNDEFINED_ID = 0xFFFFFFFF
ACL_READ, ACL_WRITE = 4, 2
_ACL_HEADER = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")


class SlotDirError(OSError):
    """The slots directory is not one the sidecar may create files in."""


def page_acl(readers: Iterable[int]) -> bytes:
    """The ACL of a page: its owner reads and writes, each uid in ``readers`` reads, nobody else anything
    (the owning group included: a job's group is no business of its GPU's neighbours)."""
    uids = sorted(set(readers))
    for uid in uids:
        if not 0 <= uid < ACL_UNDEFINED_ID:
            raise ValueError(f"uid {uid} cannot be named in a POSIX ACL")
    entries = [(ACL_USER_OBJ, ACL_READ | ACL_WRITE, ACL_UNDEFINED_ID),
               *((ACL_USER, ACL_READ, uid) for uid in uids),
               (ACL_GROUP_OBJ, 0, ACL_UNDEFINED_ID),
               (ACL_MASK, ACL_READ, ACL_UNDEFINED_ID),
               (ACL_OTHER, 0, ACL_UNDEFINED_ID)]
    return _ACL_HEADER.pack(ACL_VERSION) + b"".join(_ACL_ENTRY.pack(*e) for e in entries)


@dataclass(frozen=True)
class PageWant:
    publisher: str         # the guaranteed job's id
    writer: bytes          # the identity of its one agent that writes the page (a seqlock has one writer)
    owner: int             # its uid, as the Prolog registered it
    readers: frozenset     # the uids of the GPU's opportunistic jobs, the owner's left out (it has rw)


def wanted_pages(jobs: Iterable[RegisteredJob]) -> dict[int, PageWant]:
    """GPU -> the page it should have: one guaranteed job on it, with an agent on that GPU that can
    publish (the first registered writes), and at least one opportunistic job. Pure."""
    on: dict[int, list[RegisteredJob]] = {}
    for j in jobs:
        for g in j.gpus:
            on.setdefault(g, []).append(j)
    out = {}
    for gpu, here in on.items():
        guaranteed = [j for j in here if j.job_class == "guaranteed"]
        opportunistic = [j for j in here if j.job_class == "opportunistic"]
        if len(guaranteed) != 1 or not opportunistic:
            continue  # two guaranteed jobs on a GPU: nobody's idle time is the GPU's
        g = guaranteed[0]
        writer = next((a for a in g.agents.values() if a.gpu == gpu and p.FEATURE_SLOTS in a.reg.features), None)
        if writer is None:
            continue
        out[gpu] = PageWant(g.job_id, writer.identity, g.uid, frozenset(j.uid for j in opportunistic) - {g.uid})
    return out


@dataclass
class Page:
    gpu: int
    path: str
    publisher: str
    writer: bytes
    owner: int
    readers: frozenset
    fd: int
    generation: int  # a new file at the same path is a new page: its agents are told again


Slot = tuple[str, str, int]  # (path, role, generation): what an agent was last told


def slot_of(job: RegisteredJob, agent: AgentConnection, pages: dict[int, Page]) -> Optional[Slot]:
    if agent.gpu is None or p.FEATURE_SLOTS not in agent.reg.features:
        return None
    page = pages.get(agent.gpu)
    if page is None:
        return None
    if job.job_id == page.publisher:
        # The guaranteed job's other agents on the GPU (more ranks than GPUs) stay out of the seqlock.
        return (page.path, "publish", page.generation) if agent.identity == page.writer else None
    if job.job_class == "opportunistic":
        return page.path, "fill", page.generation
    return None


class SlotPages:
    """The page files of one sidecar, in ``ROOT/slots``."""

    def __init__(self, root: str):
        self.dir = os.path.join(root, SLOTS_DIR)
        self.pages: dict[int, Page] = {}
        self.refused = ""  # why no page is offered on this node until the sidecar restarts; "" = offered
        self._dfd: Optional[int] = None
        self._generation = itertools.count(1)
        self._rlog = RateLimitedLog(log)

    def _open_dir(self, create: bool) -> Optional[int]:
        if self._dfd is not None:
            return self._dfd
        if create:
            try:
                os.mkdir(self.dir, 0o755)
            except FileExistsError:
                pass
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if create:
                raise
            return None
        except OSError as e:
            # ELOOP (a symlink) or ENOTDIR: something else took the name; never follow it.
            raise SlotDirError(e.errno, f"{self.dir} is not a directory this sidecar made "
                                        f"({e.strerror}); no idle-slot page is offered") from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise SlotDirError(errno.EPERM, f"{self.dir} is owned by uid {st.st_uid}, not by this sidecar's "
                                            f"({os.geteuid()}); no idle-slot page is offered")
        if stat.S_IMODE(st.st_mode) != 0o755:
            os.fchmod(fd, 0o755)
        self._dfd = fd
        return fd

    def clear_stale(self) -> None:
        """Pages a previous sidecar left: their jobs' agents may still hold them open, so none is reused."""
        dfd = self._open_dir(create=False)
        if dfd is None:
            return
        for name in os.listdir(dfd):
            if _PAGE_NAME.match(name):
                try:
                    os.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    pass

    def sync(self, want: dict[int, PageWant]) -> None:
        if self.refused:
            want = {}
        for gpu, page in list(self.pages.items()):
            w = want.get(gpu)
            if w is None or (w.publisher, w.writer, w.owner) != (page.publisher, page.writer, page.owner):
                self._remove(gpu)
        for gpu, w in sorted(want.items()):
            page = self.pages.get(gpu)
            if page is None:
                self._create(gpu, w)
                if self.refused:
                    return
            elif page.readers != w.readers:
                try:
                    os.setxattr(page.fd, ACL_XATTR, page_acl(w.readers))
                    page.readers = w.readers
                except OSError as e:
                    # A reader that left could keep reading: no page rather than a wrong ACL.
                    self._rlog.warning(f"slot-acl:{gpu}", "GPU %d: cannot update its idle-slot page's ACL (%s); "
                                       "page removed", gpu, e)
                    self._remove(gpu)

    def _create(self, gpu: int, w: PageWant) -> None:
        name = f"gpu{gpu}.slots"
        path = os.path.join(self.dir, name)
        if len(path) > p.MAX_SLOT_PAGE_PATH:
            self._refuse(f"the page path {path} is longer than the protocol's {p.MAX_SLOT_PAGE_PATH} characters")
            return
        try:
            dfd = self._open_dir(create=True)
            assert dfd is not None
            try:
                os.unlink(name, dir_fd=dfd)  # a leftover is never reused: its old writer may hold it open
            except FileNotFoundError:
                pass
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:
            self._rlog.warning("slot-dir", "GPU %d: cannot create its idle-slot page: %s", gpu, e)
            return
        try:
            slot_page.init_page(fd)
            # The ACL before the owner: the file is never the job's with a wider permission than this.
            os.setxattr(fd, ACL_XATTR, page_acl(w.readers))
            if os.geteuid() == 0:
                os.fchown(fd, w.owner, -1)
        except (OSError, ValueError) as e:
            os.close(fd)
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass
            if isinstance(e, OSError) and e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
                self._refuse(f"the file system of {self.dir} has no POSIX ACLs, and a page readable by more than "
                             "its GPU's jobs is not offered")
            else:
                self._rlog.warning(f"slot-page:{gpu}", "GPU %d: cannot set up its idle-slot page: %s", gpu, e)
            return
        self.pages[gpu] = Page(gpu, path, w.publisher, w.writer, w.owner, w.readers, fd, next(self._generation))
        log.info("GPU %d: idle-slot page %s for guaranteed job %s (uid %d), readable by uid(s) %s", gpu, path,
                 w.publisher, w.owner, ", ".join(map(str, sorted(w.readers))) or "none but its owner")

    def _refuse(self, why: str) -> None:
        self.refused = why
        log.error("no idle-slot pages on this node (sidecar.slot_filling): %s", why)
        for gpu in list(self.pages):
            self._remove(gpu)

    def _remove(self, gpu: int) -> None:
        page = self.pages.pop(gpu)
        os.close(page.fd)
        try:
            os.unlink(os.path.basename(page.path), dir_fd=self._dfd)
        except FileNotFoundError:
            pass
        log.info("GPU %d: idle-slot page of job %s removed", gpu, page.publisher)

    def close(self) -> None:
        for gpu in list(self.pages):
            self._remove(gpu)
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None


class SlotPageChannel:
    """Mixed into ``daemon.Sidecar``, which makes this state: the pages kept in step with the jobs, and
    each agent with the feature told its page and role whenever that changes."""

    slot_pages: SlotPages
    jobs: dict[str, RegisteredJob]

    def _sync_slot_files(self) -> None:
        offered = self.opt.slot_filling and not self.slot_pages.refused and slot_page.check_platform() is None
        try:
            self.slot_pages.sync(wanted_pages(self.jobs.values()) if offered else {})
        except SlotDirError as e:
            self._rlog.warning("slot-dir", "%s", e.strerror)

    def _slot_fields(self, job: RegisteredJob, agent: AgentConnection) -> dict:
        """The slot fields of the next message to ``agent`` (none for an agent without the feature), and
        recorded as told: every ``registered`` and ``limits`` says the page as it is then."""
        agent.slot_sent = slot_of(job, agent, self.slot_pages.pages)
        if agent.slot_sent is None:
            return {}
        return {"slot_page": agent.slot_sent[0], "slot_role": agent.slot_sent[1]}

    def _send_slot_changes(self, now: float, skip: Optional[AgentConnection] = None) -> None:
        """``limits`` (the same limits, a new seq) to every job one of whose agents' page changed."""
        pages = self.slot_pages.pages
        for job in self.jobs.values():
            if any(a is not skip and slot_of(job, a, pages) != a.slot_sent for a in job.agents.values()):
                self._send_limits(job, now, skip=skip, restart_clock=False)
