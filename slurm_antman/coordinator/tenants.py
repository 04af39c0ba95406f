"""Tenant quotas: where they come from (Slurm accounting or antman.yaml) and what each source says.

Every Slurm site keeps its tenants in the accounting database: an account's association with
``GrpTRES=gres/gpu=N`` is how many GPUs the account may hold at once. slurm-antman reads that number as
the tenant's guaranteed quota, so an admin keeps one source of truth (``sacctmgr``). antman.yaml's
``tenants`` stay for sites without slurmdbd, and as an explicit override
(``coordinator.quota_source: antman_yaml``).

The readers here are pure (associations in, quotas and problems out); :class:`TenantQuotas` is the
coordinator's cache around them, fed by the Slurm adapter and a clock it is given.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional

from slurm_antman.policy.cluster import quotas_from_config
from slurm_antman.slurm.errors import SlurmError
from slurm_antman.slurm.models import Association

log = logging.getLogger("antman.tenants")

# The account names antman.yaml accepts: they are written into antman_quota.lua, so anything else
# (a quote, a bracket) is refused rather than escaped.
ACCOUNT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]{0,63}$")
# A GPU count no cluster reaches; a larger number is a typo, not a quota.
MAX_QUOTA_GPUS = 1_000_000
SLURMDBD = "accounting_storage/slurmdbd"
# After a failed read: soon enough that a restarted slurmdbd is noticed, rarely enough not to load it.
RETRY_S = 10.0


@dataclass(frozen=True)
class QuotaReading:
    quotas: Mapping[str, int]  # account -> GPUs; an account absent has no GPU limit (as in Slurm)
    accounts: frozenset[str]   # every account with an association on the cluster, limited or not
    problems: tuple[str, ...]  # one line each, naming the account and what is wrong


def quotas_from_associations(assocs: Iterable[Association], cluster: str, gres: str = "gpu") -> QuotaReading:
    """The account-level associations (no user) of ``cluster``: their own ``GrpTRES=gres/<gres>=N``.
    A parent account's limit is not copied to its children (Slurm enforces it on the parent's whole
    subtree; slurm-antman counts a tenant's jobs by their own account)."""
    tres = f"gres/{gres}"
    quotas: dict[str, int] = {}
    accounts: set[str] = set()
    problems: list[str] = []
    for a in assocs:
        if a.user or a.cluster != cluster:
            continue
        if not ACCOUNT_NAME.match(a.account):
            problems.append(f"account {a.account!r}: not a name slurm-antman accepts (letters, digits, _ and -, "
                            "starting with a letter); its quota is ignored")
            continue
        accounts.add(a.account)
        for name, value in sorted(a.grp_tres.items()):
            if name.startswith(tres + ":"):
                problems.append(f"account {a.account}: GrpTRES {name}={value} is a typed GPU limit; slurm-antman "
                                f"counts untyped {tres} (set GrpTRES={tres}=N)")
        value = a.grp_tres.get(tres)
        if value is None:
            continue
        if not value.isdigit() or int(value) > MAX_QUOTA_GPUS:
            problems.append(f"account {a.account}: GrpTRES {tres}={value!r} is not a GPU count "
                            f"(0 to {MAX_QUOTA_GPUS}); the account is treated as having no GPU limit")
            continue
        quotas[a.account] = int(value)
    return QuotaReading(MappingProxyType(quotas), frozenset(accounts), tuple(problems))


def disagreements(yaml_quotas: Mapping[str, int], reading: QuotaReading, cluster: str, gres: str = "gpu") -> list[str]:
    """Where antman.yaml's tenants and accounting differ, one line each (for ``antman doctor``)."""
    tres = f"gres/{gres}"
    out = []
    for account in sorted(set(yaml_quotas) | set(reading.quotas)):
        mine, theirs = yaml_quotas.get(account), reading.quotas.get(account)
        if mine is not None and account not in reading.accounts:
            out.append(f"tenant {account} (antman.yaml: {mine} GPUs) has no association in accounting "
                       f"(cluster {cluster}): sacctmgr add account {account} cluster={cluster}")
        elif mine is not None and theirs is None:
            out.append(f"tenant {account}: antman.yaml says {mine} GPUs, accounting sets no {tres} limit (unlimited)")
        elif mine is None:
            out.append(f"account {account}: accounting says {tres}={theirs}, antman.yaml lists no such tenant")
        elif mine != theirs:
            out.append(f"tenant {account}: antman.yaml says {mine} GPUs, accounting GrpTRES {tres}={theirs}")
    return out


class TenantQuotas:
    """The quotas the coordinator enforces, refreshed from accounting every ``accounting_refresh_s``.

    ``quota_source``: ``antman_yaml`` always uses antman.yaml; ``auto`` uses accounting when slurmctld
    runs with slurmdbd and antman.yaml otherwise; ``accounting`` insists on it (an error, logged and in
    :attr:`error`, while Slurm has no accounting storage). Until accounting first answers, antman.yaml's tenants are
    used (a coordinator starting beside a slurmdbd that is not up yet must not hold every job); after
    that, a failed read keeps the last quotas read, so a slurmdbd restart changes nothing.

    ``background``: read in a thread of its own, so that a slow slurmdbd (sacctmgr waits up to the
    backend's timeout) never holds up the coordinator's decision cycle; :meth:`current` always answers
    at once with the quotas read last. The daemon uses it; the rules above are tested in the foreground."""

    def __init__(self, cfg: Any, backend: Any, clock: Callable[[], float], background: bool = False):
        self.cfg = cfg
        self.background = background
        self._reader: Optional[threading.Thread] = None
        self.backend = backend
        self.clock = clock
        self.mode: str = cfg.coordinator.quota_source
        self.source = "antman.yaml"
        self.quotas: Mapping[str, int] = quotas_from_config(cfg)
        self.reading: Optional[QuotaReading] = None
        self.error: Optional[str] = None
        self.read_unix: Optional[float] = None
        self._storage: Optional[str] = None  # Slurm's AccountingStorageType, once known
        self._next_try = float("-inf")
        self._problems_logged: tuple[str, ...] = ()

    def current(self) -> Mapping[str, int]:
        if self.mode != "antman_yaml" and self.clock() >= self._next_try:
            if not self.background:
                self._refresh()
            elif self._reader is None or not self._reader.is_alive():
                self._next_try = float("inf")  # the reader sets the next time when it is done
                self._reader = threading.Thread(target=self._refresh_guarded, name="tenant-quotas", daemon=True)
                self._reader.start()
        return self.quotas  # one reference, replaced whole by the reader: never half a reading

    def _refresh_guarded(self) -> None:
        try:
            self._refresh()
        except Exception:  # noqa: BLE001 - a bug here must leave the quotas as they were, not end the reader for good
            log.exception("reading tenant quotas from Slurm accounting failed")
            self._next_try = self.clock() + RETRY_S

    def _refresh(self) -> None:
        now = self.clock()
        self._next_try = now + min(RETRY_S, self.cfg.coordinator.accounting_refresh_s)
        try:
            if self._storage is None:
                self._storage = self.backend.config().get("AccountingStorageType", "")
            if self._storage != SLURMDBD:
                if self.mode == "accounting":
                    self._fail(f"coordinator.quota_source is accounting but slurmctld runs with "
                               f"AccountingStorageType={self._storage or '(unset)'}; set AccountingStorageType="
                               f"{SLURMDBD} in slurm.conf, or quota_source: auto", logging.ERROR)
                    self._storage = None  # slurm.conf may be fixed and slurmctld restarted: ask again
                else:
                    self._next_try = float("inf")  # auto, no accounting: antman.yaml until a reload
                return
            reading = quotas_from_associations(self.backend.associations(self.cfg.cluster_name),
                                               self.cfg.cluster_name, self.cfg.slurm.gpu_gres)
        except SlurmError as e:
            self._fail(f"cannot read tenant quotas from Slurm accounting: {e}", logging.WARNING)
            return
        if self.source != "accounting":
            log.info("tenant quotas from Slurm accounting (%d account(s) with a GPU limit)", len(reading.quotas))
        yaml_q = quotas_from_config(self.cfg)
        differ = disagreements(yaml_q, reading, self.cfg.cluster_name, self.cfg.slurm.gpu_gres) if yaml_q else []
        problems = (*reading.problems,
                    *(f"{d} (accounting is in force; antman.yaml's tenants are not used)" for d in differ))
        if problems != self._problems_logged:  # once per change, not once per refresh
            for p in problems:
                log.warning("accounting: %s", p)
            self._problems_logged = problems
        self.source, self.quotas, self.reading, self.error, self.read_unix = (
            "accounting", reading.quotas, reading, None, now)
        self._next_try = now + self.cfg.coordinator.accounting_refresh_s

    def _fail(self, message: str, level: int) -> None:
        if self.error != message:  # once per cause, not once per cycle
            log.log(level, "%s; keeping %s quotas", message,
                    "the last accounting" if self.source == "accounting" else "antman.yaml")
        self.error = message
