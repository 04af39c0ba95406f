"""Tenant quotas from Slurm accounting: sacctmgr's output parsed, GrpTRES read as a GPU quota, the
coordinator's cache (source, fallback, last-known on failure). The real sacctmgr against slurmdbd and
MariaDB is exercised in test_accounting_cluster.py."""

from __future__ import annotations

import logging

import pytest

from slurm_antman import config as cfgmod
from slurm_antman.slurm.errors import SlurmOutputError, SlurmUnavailable
from slurm_antman.slurm.models import Association
from slurm_antman.slurm.parsing import associations_from_sacctmgr, parse_scontrol_config, parse_tres
from slurm_antman.coordinator.tenants import TenantQuotas, disagreements, quotas_from_associations

# What `sacctmgr -n -P show associations format=Cluster,Account,User,ParentName,GrpTRES` printed on the
# devcluster (22.05.8) after `sacctmgr modify account research set GrpTRES=gres/gpu=3`.
SACCTMGR = """\
antmandev|root|||
antmandev|root|root||
antmandev|product||root|cpu=8,gres/gpu=2
antmandev|product|root||
antmandev|research||root|gres/gpu=3
antmandev|research|root||
othercluster|research||root|gres/gpu=40
"""


def assoc(account, tres="", user="", cluster="c1"):
    return Association(cluster, account, user, "root", parse_tres(tres))


def test_sacctmgr_rows_parse_into_associations():
    rows = associations_from_sacctmgr(SACCTMGR)
    assert len(rows) == 7
    product = next(r for r in rows if r.account == "product" and not r.user)
    assert product.grp_tres == {"cpu": "8", "gres/gpu": "2"} and product.parent == "root"
    assert [r.user for r in rows if r.account == "research"] == ["", "root", ""]


def test_a_row_with_the_wrong_number_of_fields_names_the_row():
    with pytest.raises(SlurmOutputError, match=r"row 2 has 3 fields, expected 5"):
        associations_from_sacctmgr("c|a|||\nc|a|b\n")
    with pytest.raises(SlurmOutputError, match=r"row 1 \(account 'a'\): GrpTRES TRES item 'gpu' is not NAME=VALUE"):
        associations_from_sacctmgr("c|a||root|gpu\n")


def test_quotas_are_the_account_level_gpu_limits_of_this_cluster():
    r = quotas_from_associations(associations_from_sacctmgr(SACCTMGR), "antmandev")
    assert dict(r.quotas) == {"product": 2, "research": 3}  # not othercluster's 40, not user rows
    assert r.accounts == {"root", "product", "research"}
    assert r.problems == ()
    # an account without a GPU limit is unlimited, as in Slurm: absent from the quotas
    assert "root" not in r.quotas


def test_a_quota_that_is_not_a_gpu_count_is_a_named_problem_not_a_quota():
    r = quotas_from_associations([assoc("typed", "gres/gpu:a100=4"), assoc("huge", "gres/gpu=99999999"),
                                  assoc("neg", "gres/gpu=-1"), assoc("ok", "gres/gpu=0"),
                                  assoc('bad"name', "gres/gpu=1")], "c1")
    assert dict(r.quotas) == {"ok": 0}
    text = "\n".join(r.problems)
    assert "account typed: GrpTRES gres/gpu:a100=4 is a typed GPU limit" in text
    assert "account huge: GrpTRES gres/gpu='99999999' is not a GPU count" in text
    assert "account neg: GrpTRES gres/gpu='-1' is not a GPU count" in text
    assert "account 'bad\"name': not a name slurm-antman accepts" in text
    assert len(r.problems) == 4


def test_the_gpu_gres_name_comes_from_the_config():
    r = quotas_from_associations([assoc("a", "gres/gpu=4,gres/tesla=2")], "c1", gres="tesla")
    assert dict(r.quotas) == {"a": 2}


def test_disagreements_name_each_account_and_both_numbers():
    reading = quotas_from_associations([assoc("same", "gres/gpu=2"), assoc("differ", "gres/gpu=1"),
                                        assoc("unlimited"), assoc("extra", "gres/gpu=5")], "c1")
    lines = disagreements({"same": 2, "differ": 4, "unlimited": 3, "missing": 1}, reading, "c1")
    assert lines == [
        "tenant differ: antman.yaml says 4 GPUs, accounting GrpTRES gres/gpu=1",
        "account extra: accounting says gres/gpu=5, antman.yaml lists no such tenant",
        "tenant missing (antman.yaml: 1 GPUs) has no association in accounting (cluster c1): "
        "sacctmgr add account missing cluster=c1",
        "tenant unlimited: antman.yaml says 3 GPUs, accounting sets no gres/gpu limit (unlimited)",
    ]


def test_scontrol_show_config_lines():
    conf = parse_scontrol_config("Configuration data as of 2026-11-25T05:00:00\n"
                                 "AccountingStorageType   = accounting_storage/slurmdbd\nAccountingStorageUser   = \n")
    assert conf == {"AccountingStorageType": "accounting_storage/slurmdbd", "AccountingStorageUser": ""}


# --- the coordinator's cache -------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class ScriptedSlurm:
    """The two adapter calls TenantQuotas makes, answering from a script (no Slurm needed for the
    cache's rules; the real commands are tested against slurmdbd in test_accounting_cluster.py)."""

    def __init__(self, storage="accounting_storage/slurmdbd", rows=()):
        self.storage = storage
        self.rows = list(rows)
        self.fail: Exception | None = None
        self.calls = 0

    def config(self):
        return {"AccountingStorageType": self.storage}

    def associations(self, cluster=None):
        self.calls += 1
        if self.fail:
            raise self.fail
        return [r for r in self.rows if cluster is None or r.cluster == cluster]


def cfg(source="auto", refresh=60.0, tenants=({"account": "research", "guaranteed_gpus": 4},)):
    return cfgmod.AntmanConfig.model_validate({
        "cluster_name": "c1", "nodes": [{"name": "n1", "gpus": 1}], "tenants": list(tenants),
        "coordinator": {"quota_source": source, "accounting_refresh_s": refresh}})


def test_auto_uses_accounting_when_slurm_has_slurmdbd_and_refreshes_on_its_interval():
    clock, slurm = FakeClock(), ScriptedSlurm(rows=[assoc("research", "gres/gpu=2")])
    tq = TenantQuotas(cfg(refresh=60), slurm, clock)
    assert dict(tq.current()) == {"research": 2} and tq.source == "accounting"
    slurm.rows = [assoc("research", "gres/gpu=6")]
    clock.t += 30
    assert dict(tq.current()) == {"research": 2}  # not yet
    clock.t += 31
    assert dict(tq.current()) == {"research": 6}
    assert slurm.calls == 2


def test_auto_without_accounting_storage_is_antman_yaml_and_never_asks_sacctmgr():
    clock, slurm = FakeClock(), ScriptedSlurm(storage="accounting_storage/none")
    tq = TenantQuotas(cfg(), slurm, clock)
    for _ in range(3):
        clock.t += 100
        assert dict(tq.current()) == {"research": 4}
    assert tq.source == "antman.yaml" and tq.error is None and slurm.calls == 0


def test_antman_yaml_overrides_accounting():
    slurm = ScriptedSlurm(rows=[assoc("research", "gres/gpu=1")])
    tq = TenantQuotas(cfg(source="antman_yaml"), slurm, FakeClock())
    assert dict(tq.current()) == {"research": 4} and slurm.calls == 0


def test_accounting_demanded_without_slurmdbd_is_an_error_naming_the_setting(caplog):
    tq = TenantQuotas(cfg(source="accounting"), ScriptedSlurm(storage="accounting_storage/none"), FakeClock())
    with caplog.at_level(logging.ERROR, "antman.tenants"):
        assert dict(tq.current()) == {"research": 4}
    assert "AccountingStorageType=accounting_storage/none" in tq.error
    assert "quota_source: auto" in caplog.text


def test_before_accounting_answers_antman_yaml_after_that_the_last_reading_survives_failures(caplog):
    clock, slurm = FakeClock(), ScriptedSlurm(rows=[assoc("research", "gres/gpu=2")])
    slurm.fail = SlurmUnavailable("Connection refused")
    tq = TenantQuotas(cfg(refresh=60), slurm, clock)
    assert dict(tq.current()) == {"research": 4} and tq.source == "antman.yaml" and tq.error
    clock.t += 5
    tq.current()
    assert slurm.calls == 1  # a failure is retried after 10 s, not every cycle
    slurm.fail = None
    clock.t += 6
    assert dict(tq.current()) == {"research": 2} and tq.source == "accounting" and tq.error is None
    slurm.fail = SlurmUnavailable("slurmdbd restarting")
    clock.t += 61
    with caplog.at_level(logging.WARNING, "antman.tenants"):
        assert dict(tq.current()) == {"research": 2}  # last known, not antman.yaml's 4
        clock.t += 11
        tq.current()
    assert tq.source == "accounting" and "slurmdbd restarting" in tq.error
    assert caplog.text.count("slurmdbd restarting") == 1  # logged once per cause


def test_coordinator_quota_source_is_validated():
    with pytest.raises(cfgmod.ConfigError, match="quota_source") as e:
        cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "coordinator": {"quota_source": "ldap"}})
    assert "antman_yaml" in str(e.value)  # the allowed values are named


def test_the_coordinator_logs_each_disagreement_with_antman_yaml_once(caplog):
    clock, slurm = FakeClock(), ScriptedSlurm(rows=[assoc("research", "gres/gpu=2")])
    tq = TenantQuotas(cfg(refresh=1), slurm, clock)
    with caplog.at_level(logging.WARNING, "antman.tenants"):
        for _ in range(3):
            tq.current()
            clock.t += 2
    assert slurm.calls == 3
    assert caplog.text.count("tenant research: antman.yaml says 4 GPUs, accounting GrpTRES gres/gpu=2 "
                             "(accounting is in force") == 1


def test_in_the_background_a_slow_accounting_never_holds_up_the_caller():
    import threading

    gate, entered = threading.Event(), threading.Event()

    class SlowSlurm(ScriptedSlurm):
        def associations(self, cluster=None):
            entered.set()
            gate.wait(10)  # slurmdbd taking its time
            return super().associations(cluster)

    clock, slurm = FakeClock(), SlowSlurm(rows=[assoc("research", "gres/gpu=2")])
    tq = TenantQuotas(cfg(refresh=60), slurm, clock, background=True)
    assert dict(tq.current()) == {"research": 4}  # answered at once, from antman.yaml
    assert entered.wait(5)
    reader = tq._reader
    clock.t += 100
    assert dict(tq.current()) == {"research": 4} and tq._reader is reader  # one reader at a time
    gate.set()
    tq._reader.join(5)
    assert dict(tq.current()) == {"research": 2} and tq.source == "accounting"
    tq._reader.join(5)  # that reading was taken at t=1000, due again at 1060 < now: a second one
    assert slurm.calls == 2


def test_in_the_background_a_bug_in_the_reader_keeps_the_quotas(caplog):
    class Broken(ScriptedSlurm):
        def config(self):
            raise KeyError("surprise")

    clock = FakeClock()
    tq = TenantQuotas(cfg(), Broken(), clock, background=True)
    with caplog.at_level(logging.ERROR, "antman.tenants"):
        tq.current()
        tq._reader.join(5)
    assert dict(tq.current()) == {"research": 4} and "surprise" in caplog.text
    clock.t += 11
    tq.current()
    tq._reader.join(5)  # retried after RETRY_S, not given up
    assert caplog.text.count("surprise") >= 2
