"""The install guide (docs/admin.md), followed as a new site admin would, on a fresh plain Slurm.

The shell blocks marked ``<!-- admin-guide-test -->`` are run in order, unchanged, in one
``bash -euo pipefail``; the guide's directory variables point into a temporary "site". Then the
checks an admin would make: ``sbatch --help`` shows ``--antman``, ``antman doctor`` passes its plugin
and configuration checks, and an opportunistic job is classified. If a command in the guide stops
matching the code, this test fails, so the guide cannot drift.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from slurm_antman.lab.devcluster import cluster as dc

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "admin.md"
MARKER = "<!-- admin-guide-test -->"
PORT_BASE = 19317

# A marker line, then a ```sh fence at any indentation (list items indent theirs), up to its closing fence.
_BLOCK = re.compile(r"^[ \t]*" + re.escape(MARKER) + r"[ \t]*\n([ \t]*)```sh[ \t]*\n(.*?)^\1```[ \t]*$",
                    re.M | re.S)


def guide_blocks(text: str) -> list[str]:
    blocks = [textwrap.dedent(body) for _, body in _BLOCK.findall(text)]
    # A marker not followed by a ```sh block would silently drop commands from the test.
    markers = re.findall(r"^[ \t]*" + re.escape(MARKER) + r"[ \t]*$", text, re.M)
    assert len(blocks) == len(markers), "every admin-guide-test marker must precede a ```sh block"
    return blocks


def test_guide_blocks_are_found():
    text = GUIDE.read_text()
    blocks = guide_blocks(text)
    assert len(blocks) >= 8
    joined = "\n".join(blocks)
    for cmd in ("make install", "antman config render", "antman keys init", "scontrol reconfigure"):
        assert cmd in joined, f"{cmd} is no longer among the tested blocks of docs/admin.md"
    # The guide's commands must not hard-code the paths the test redirects.
    assert "/etc/slurm-antman/" not in joined.split("\n", 3)[3]


def test_marker_without_block_is_an_error():
    with pytest.raises(AssertionError, match="must precede"):
        guide_blocks(f"{MARKER}\n```\nplain fence\n```\n")


@pytest.mark.cluster
@pytest.mark.timeout(420)
def test_admin_guide_installs_on_plain_slurm(tmp_path):
    from conftest import _require_slurm

    _require_slurm()
    blocks = guide_blocks(GUIDE.read_text())
    site = tmp_path / "site"
    cluster = dc.up(tmp_path / "cluster", nodes=1, gpus=2, port_base=PORT_BASE, plain=True)
    try:
        etc = cluster.slurm_conf.parent
        include = f"Include {etc}/antman.slurm.conf"
        assert "JobSubmitPlugins" not in (etc / "antman.slurm.conf").read_text()
        # This site has a job_submit.lua of its own (the example's rules, before slurm-antman's line), and
        # a SlurmctldParameters of its own (the devcluster's enable_configless): the guide must keep both.
        site_lua = "".join(l for l in (REPO / "etc" / "examples" / "job_submit.lua").read_text().splitlines(True)
                           if "antman_job_submit.lua" not in l)
        (etc / "job_submit.lua").write_text(site_lua)
        assert "SlurmctldParameters=enable_configless" in cluster.slurm_conf.read_text().splitlines()

        # What the admin types into $EDITOR: this cluster's nodes, the plugin where step 2 installs it.
        antman_etc, plugin_dir = site / "etc" / "slurm-antman", site / "lib" / "slurm"
        raw = yaml.safe_load(cluster.config_path.read_text())
        raw["plugin_path"] = str(plugin_dir / "antman_spank.so")
        # What this loopback site's node line needs beyond CPUs, memory and GRES.
        raw["nodes"][0]["slurm_params"] = f"Port={PORT_BASE + 1} NodeHostname=localhost"
        raw["coordinator"]["key_dir"] = str(antman_etc / "keys")
        prefix, bin_dir = site / "opt" / "slurm-antman", site / "bin"
        raw["agent_path"] = str(prefix / "agent")
        raw["antman_command"] = str(prefix / "bin" / "antman")
        edited = tmp_path / "edited-antman.yaml"
        edited.write_text(yaml.safe_dump(raw, sort_keys=False))

        # The guide names its own file; its `antman` is the one its `make install` links into BINDIR.
        env = {k: v for k, v in cluster.env.items() if k not in ("ANTMAN_CONFIG", "PYTHONPATH")}
        env.update({
            "ANTMAN_ETC": str(antman_etc), "SLURM_ETC": str(etc), "PLUGIN_DIR": str(plugin_dir),
            "PREFIX": str(prefix), "BINDIR": str(bin_dir), "UNIT_DIR": str(site / "systemd"),
            "EDITOR": f"cp {edited}",
            # This site's slurmd listens on its own port of localhost (the devcluster runs it so).
            "BUILDDIR": str(tmp_path / "spank-build"),  # the spank Makefile's ?= : leave the checkout clean
            "PATH": f"{bin_dir}:{env['PATH']}",
        })
        script = "\n".join(blocks)
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=360)
        assert r.returncode == 0, f"the guide's commands failed:\n{script}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"

        # What the steps left behind: the install, and the files Slurm reads.
        assert (plugin_dir / "antman_spank.so").is_file()
        assert os.readlink(bin_dir / "antman") == str(prefix / "bin" / "antman")
        assert (prefix / "agent" / "sitecustomize.py").is_file()
        assert f"include {etc}/plugstack.conf.d/antman.conf" in (etc / "plugstack.conf").read_text().splitlines()
        assert (antman_etc / "rendered" / "antman-prolog").stat().st_mode & 0o111
        assert (antman_etc / "keys" / "coordinator.key").is_file()
        assert (antman_etc / "keys" / "sidecars" / "node1.key").is_file()
        assert cluster.slurm_conf.read_text().count(include) == 1  # the include step is idempotent
        # Merged, never overwritten: the site's own values and script are still there, with antman's added.
        conf = cluster.slurm_conf.read_text().splitlines()
        assert "SlurmctldParameters=enable_configless,preempt_send_user_signal" in conf
        assert "JobSubmitPlugins=lua" in conf and f"Prolog={antman_etc}/rendered/antman-prolog" in conf
        assert list(etc.glob("slurm.conf.before-antman-*"))
        lua = (etc / "job_submit.lua").read_text()
        assert lua.endswith(site_lua) and lua.count("antman_job_submit.lua\").chain()") == 1
        assert (etc / "job_submit.lua.before-antman").read_text() == site_lua
        assert (etc / "cli_filter.lua").read_text() == (REPO / "etc" / "cli_filter.lua").read_text()

        # The checks a new admin makes.
        help_text = cluster.run(["sbatch", "--help"], env=env).stdout
        assert "--antman" in help_text

        r = subprocess.run(["antman", "doctor", "--config", str(antman_etc / "antman.yaml"), "--node", "node1",
                            "--json"], env=env, capture_output=True, text=True, timeout=120)
        checks = {c["name"]: c for c in json.loads(r.stdout)}
        for name in ("config", "spank_plugin", "plugstack", "sbatch_option", "slurm_version", "slurm_conf",
                     "job_submit", "prolog_epilog"):
            assert checks[name]["status"] == "ok", (name, checks[name])
        # No sidecar runs yet (step 8): doctor must say so rather than pass it.
        assert checks["sidecar"]["status"] == "fail"

        r = cluster.run(["sbatch", "--parsable", "--antman=opportunistic", "--gres=gpu:1", "-D", str(tmp_path),
                         "-o", "/dev/null", "--hold", "--wrap", "true"], env=env)
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().split(";")[0]
        show = cluster.run(["scontrol", "show", "job", "-o", job], env=env).stdout
        assert "AdminComment=antman:class=opportunistic" in show, show
        assert re.search(r"\bPartition=opportunistic\b", show), show
        assert "antman_opp" in show and "gres/gpu" not in show.replace("gres/antman_opp", ""), show
        assert "TimeLimit=1-00:00:00" in show, show  # the site's own rule ran too, before antman's
        cluster.run(["scancel", job], env=env)
    finally:
        dc.down(cluster.dir)
