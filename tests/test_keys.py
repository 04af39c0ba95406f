"""`antman keys init`: the CURVE key files of the uplink, their permissions, idempotence, errors."""

from __future__ import annotations

import os
import stat

import pytest
import yaml
import zmq.auth

from slurm_antman import curve_keys as keys


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _write_config(tmp_path, key_dir=None, nodes="n[1-2]"):
    data = {"nodes": [{"name": nodes, "gpus": 1}]}
    if key_dir is not None:
        data["coordinator"] = {"key_dir": str(key_dir)}
    path = tmp_path / "antman.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_init_creates_root_only_keys_for_every_node(tmp_path, capsys):
    kd = tmp_path / "keys"
    assert keys.main(["init", "--config", _write_config(tmp_path, kd)]) == 0
    assert "created coordinator, n1, n2" in capsys.readouterr().out
    for d in (kd, kd / "sidecars", kd / "nodes"):
        assert _mode(d) == 0o700
    files = [kd / "coordinator.key", kd / "coordinator.key_secret", kd / "sidecars" / "n1.key",
             kd / "sidecars" / "n2.key", kd / "nodes" / "n1.key_secret", kd / "nodes" / "n2.key_secret"]
    for f in files:
        assert _mode(f) == 0o600, f
        if os.geteuid() == 0:
            assert os.stat(f).st_uid == 0
    # The admitted public key is the node's own key pair's public half; the server pair loads.
    pub, sec = keys.load_keypair(kd / "nodes" / "n1.key_secret")
    assert sec and keys.authorized_sidecars(kd) == {
        pub: "n1", keys.load_keypair(kd / "nodes" / "n2.key_secret")[0]: "n2"}
    spub, ssec = keys.load_server_keypair(kd)
    assert spub == keys.load_server_public(kd) and ssec
    assert not list(kd.glob(".new-*"))  # the staging directory is gone


def test_init_keeps_existing_keys_and_force_replaces_them(tmp_path):
    kd = tmp_path / "keys"
    keys.init_keys(kd, ["n1"])
    before = (keys.load_server_public(kd), keys.load_keypair(kd / "nodes" / "n1.key_secret"))
    res = keys.init_keys(kd, ["n1", "n2"])
    assert res.created == ["n2"] and res.kept == ["coordinator", "n1"]
    assert (keys.load_server_public(kd), keys.load_keypair(kd / "nodes" / "n1.key_secret")) == before
    # A lost authorization file is re-derived from the node's existing key, not rotated.
    (kd / "sidecars" / "n1.key").unlink()
    keys.init_keys(kd, ["n1"])
    assert keys.authorized_sidecars(kd)[before[1][0]] == "n1"
    res = keys.init_keys(kd, ["n1"], force=True)
    assert res.created == ["coordinator", "n1"]
    assert keys.load_server_public(kd) != before[0]
    assert keys.load_keypair(kd / "nodes" / "n1.key_secret") != before[1]
    # The old n1 public key is no longer admitted.
    assert before[1][0] not in keys.authorized_sidecars(kd)


def test_scan_skips_and_names_bad_files(tmp_path):
    kd = tmp_path / "keys"
    keys.init_keys(kd, ["n1"])
    (kd / "sidecars" / "junk.key").write_text("not a certificate\n")
    (kd / "sidecars" / "bad name!.key").write_text("x")
    found, problems = keys.scan_authorized(kd)
    assert sorted(found.values()) == ["n1"]
    assert any("junk.key" in p for p in problems) and any("not a node name" in p for p in problems)


def test_missing_and_wrong_key_files_are_clear_errors(tmp_path):
    with pytest.raises(keys.KeysError, match="no such key file.*antman keys init"):
        keys.load_server_keypair(tmp_path)
    zmq.auth.create_certificates(str(tmp_path), "pubonly")
    with pytest.raises(keys.KeysError, match="holds no secret key"):
        keys.load_keypair(tmp_path / "pubonly.key")
    with pytest.raises(keys.KeysError, match="not a Slurm node name"):
        keys.init_keys(tmp_path / "k", ["../etc"])


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert keys.main(["init", "--config", _write_config(tmp_path)]) == 2
    assert "coordinator.key_dir is not set" in capsys.readouterr().err
    cfg = _write_config(tmp_path, tmp_path / "k")
    assert keys.main(["init", "--config", cfg, "--nodes", "n[1-3]"]) == 2
    assert "n3 not in antman.yaml nodes" in capsys.readouterr().err
    assert keys.main(["init", "--config", cfg, "--nodes", "n[1-"]) == 2
    assert "--nodes" in capsys.readouterr().err
    assert keys.main(["init", "--config", cfg, "--nodes", "n2"]) == 0
    assert sorted(keys.authorized_sidecars(tmp_path / "k").values()) == ["n2"]
    assert keys.main(["init", "--config", str(tmp_path / "missing.yaml")]) == 2
