"""Every implementation of a contract between the parts against its one written source.

docs/protocol.md ("Contracts between the parts") states the job env file, the AdminComment tag and
the environment variable names; docs/contracts.json holds their vectors. Each test here runs one
implementation on those vectors: Python (jobtag, envfile, protocol), C (spank/envfile.c compiled
into a small harness, spank/common.h) and Lua (etc/antman_job_submit.lua, etc/antman_cli_filter.lua
under lua5.1). A vector changed here changes what every language must do.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest

from slurm_antman import jobtag, protocol
from slurm_antman.errors import AntmanError

REPO = Path(__file__).resolve().parent.parent
VECTORS_PATH = REPO / "docs" / "contracts.json"
VECTORS = json.loads(VECTORS_PATH.read_text())
ENV = VECTORS["env_file"]
TAG = VECTORS["job_tag"]
ELASTIC = TAG["elastic"]
ENV_NAMES = set(VECTORS["env_names"])
LUA = shutil.which("lua5.1")
CC = shutil.which("cc") or shutil.which("gcc")
SPANK_H = Path("/usr/include/slurm/spank.h")

needs_lua = pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed (apt-get install lua5.1)")
needs_cc = pytest.mark.skipif(CC is None or not SPANK_H.exists(),
                              reason="a C compiler and Slurm's headers (libslurm-dev) are needed")


def _id(v: Any) -> str:
    return v.get("name") or v.get("text") or json.dumps(v) if isinstance(v, dict) else repr(v)


# ---------------------------------------------------------------------------------------------------
# The env file's vectors as bytes and as the environment they must give


def env_data(vector: dict[str, Any]) -> bytes:
    if "data_hex" in vector:
        return bytes.fromhex(vector["data_hex"])
    if "text" in vector:
        return vector["text"].encode()
    gen = vector["generate"]
    if "entries" in gen:
        return "".join(f"{gen['key'] % i}={gen['value'] % i}\n" for i in range(gen["entries"])).encode()
    return b"A=" + b"x" * (gen["bytes"] - 3) + b"\n"


def expected_env(vector: dict[str, Any]) -> Optional[dict[bytes, bytes]]:
    """None when the file must not be applied at all."""
    if vector.get("refused"):
        return None
    if "env" in vector:
        return {k.encode(): v.encode() for k, v in vector["env"].items()}
    if "env_hex" in vector:
        return {k.encode(): bytes.fromhex(v) for k, v in vector["env_hex"].items()}
    if "env_first_n" in vector:
        gen = vector["generate"]
        return {(gen["key"] % i).encode(): (gen["value"] % i).encode() for i in range(vector["env_first_n"])}
    if vector.get("refused") is False:
        return {b"A": env_data(vector)[2:-1]}
    raise AssertionError(f"vector {vector.get('name')!r} says nothing about its outcome")


def keys_mentioned(data: bytes) -> set[bytes]:
    """Every KEY= at a line start, skipped lines included: a reader must not find the skipped ones."""
    return set(re.findall(rb"^([A-Z_][A-Z0-9_]*)=", data, re.M))


# ---------------------------------------------------------------------------------------------------
# Python: slurm_antman/jobtag.py


def test_vectors_are_consistent() -> None:
    assert TAG["prefix"] == jobtag.PREFIX
    assert tuple(TAG["classes"]) == jobtag.CLASSES
    assert tuple(TAG["requests"]) == jobtag.REQUESTS
    assert tuple(TAG["holds"]) == jobtag.HOLDS
    assert ELASTIC["max_gpus"] == jobtag.ELASTIC_MAX == protocol.MAX_JOB_GPUS
    values = [v["text"] for v in ELASTIC["valid"]] + ELASTIC["invalid"]
    assert len(values) == len(set(values)), "an elastic value is listed twice"
    texts = [v["text"] for v in TAG["valid"]] + [v["text"] for v in TAG["invalid"]]
    assert len(texts) == len(set(texts)), "a vector is listed twice"


@pytest.mark.parametrize("v", TAG["valid"], ids=_id)
def test_python_parses_valid_tags(v: dict[str, Any]) -> None:
    tag = jobtag.parse_tag(v["text"])
    assert tag is not None
    assert tag.job_class == v["class"]
    assert tag.request == v["request"]
    assert tag.hold == v.get("hold")
    assert tag.gpus == v.get("gpus", {})
    assert [list(e) for e in tag.extra] == v.get("extra", [])
    assert tag.elastic == (tuple(v["elastic"]) if "elastic" in v else None)
    canonical = v.get("canonical", v["text"])
    assert tag.render() == canonical
    assert jobtag.parse_tag(canonical) == tag


@pytest.mark.parametrize("v", TAG["invalid"], ids=_id)
def test_python_refuses_damaged_tags(v: dict[str, Any]) -> None:
    with pytest.raises(jobtag.TagError) as e:
        jobtag.parse_tag(v["text"])
    # the CLI prints an AntmanError as one line; older callers still catch ValueError
    assert isinstance(e.value, AntmanError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("text", TAG["none"], ids=repr)
def test_python_sees_no_tag(text: Optional[str]) -> None:
    assert jobtag.parse_tag(text) is None


@pytest.mark.parametrize("v", TAG["written_at_submission"], ids=_id)
def test_python_writes_what_submission_writes(v: dict[str, Any]) -> None:
    elastic = tuple(v["elastic"]) if "elastic" in v else None
    tag = jobtag.JobTag(v["class"], requested=v["request"], elastic=elastic)
    assert tag.render() == v["text"]
    assert jobtag.parse_tag(v["text"]).request == v["request"]
    assert jobtag.parse_tag(v["text"]).elastic == elastic


@pytest.mark.parametrize("v", ELASTIC["valid"], ids=_id)
def test_python_reads_elastic_values(v: dict[str, Any]) -> None:
    assert jobtag.parse_elastic(v["text"]) == (v["min"], v["max"])
    assert jobtag.parse_tag(f"antman:class=opportunistic;elastic={v['text']}").elastic == (v["min"], v["max"])


@pytest.mark.parametrize("text", ELASTIC["invalid"], ids=repr)
def test_python_refuses_bad_elastic_values(text: str) -> None:
    with pytest.raises(jobtag.TagError, match="elastic"):
        jobtag.parse_elastic(text)
    if ";" not in text:
        with pytest.raises(jobtag.TagError, match="elastic"):
            jobtag.parse_tag(f"antman:class=opportunistic;elastic={text}")


def test_slurm_readers_read_tags_as_jobtag_does() -> None:
    """slurm/tag.py reads the tag for every Slurm listing, tolerantly: the same reading, with a damaged
    tag reported in ``problem`` instead of raised."""
    tag_mod = pytest.importorskip("slurm_antman.slurm.tag")
    for v in TAG["valid"]:
        got = tag_mod.read_admin_comment(v["text"])
        assert (got.job_class, got.gpus_by_node, got.problem) == (v["class"], v.get("gpus", {}), None), v["text"]
    for v in TAG["invalid"]:
        assert tag_mod.read_admin_comment(v["text"]).problem, v["text"]
    for text in TAG["none"]:
        got = tag_mod.read_admin_comment(text)
        assert (got.job_class, got.problem, got.tag) == ("none", None, None), text


# ---------------------------------------------------------------------------------------------------
# Python: slurm_antman/envfile.py


@pytest.fixture(scope="module")
def envfile() -> Any:
    return pytest.importorskip("slurm_antman.envfile")


@pytest.mark.parametrize("v", ENV["path"], ids=_id)
def test_python_env_file_path(envfile: Any, v: dict[str, str]) -> None:
    assert str(envfile.path(v["state_dir"], v["node"], v["job_id"])) == v["path"]


def test_python_env_file_limits(envfile: Any) -> None:
    limits = ENV["limits"]
    assert envfile.MAX_BYTES == limits["max_bytes"]
    assert envfile.MAX_ENTRIES == limits["max_entries"]
    assert envfile.KEY_PATTERN == limits["key"]
    assert envfile.NODE_NAME_RE.pattern == limits["node"]
    for name in ENV["node_names"]["valid"]:
        assert envfile.NODE_NAME_RE.fullmatch(name), name
    for name in ENV["node_names"]["invalid"]:
        assert not envfile.NODE_NAME_RE.fullmatch(name), name
        # root writes at this path: a name the plugin would never read under is refused, not written
        with pytest.raises(envfile.EnvFileError):
            envfile.path("/var/lib/antman", name, "7")
    with pytest.raises(envfile.EnvFileError):
        envfile.path("/var/lib/antman", "node1", "7/../../x")


@pytest.mark.parametrize("v", ENV["parse"], ids=_id)
def test_python_reads_env_files(envfile: Any, v: dict[str, Any]) -> None:
    want = expected_env(v)
    if want is None:
        with pytest.raises(envfile.EnvFileError):
            envfile.parse_env(env_data(v))
        return
    got = envfile.parse_env(env_data(v))
    assert {k.encode(): val.encode("utf-8", "surrogateescape") for k, val in got.items()} == want


@pytest.mark.parametrize("v", ENV["format"], ids=_id)
def test_python_writes_only_what_the_plugin_reads_back(envfile: Any, v: dict[str, Any]) -> None:
    if not v["ok"]:
        with pytest.raises(envfile.EnvFileError):
            envfile.format_env(v["values"])
        return
    assert envfile.parse_env(envfile.format_env(v["values"])) == v["values"]


# ---------------------------------------------------------------------------------------------------
# C: spank/envfile.c, compiled into tests/contracts/envfile_harness.c


@pytest.fixture(scope="module")
def c_reader(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CC is None or not SPANK_H.exists():
        pytest.skip("a C compiler and Slurm's headers (libslurm-dev) are needed")
    exe = tmp_path_factory.mktemp("c-envfile") / "harness"
    # The plugin's own warning flags: the harness must not need looser rules than the plugin.
    res = subprocess.run(
        [CC, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wshadow", "-Wformat=2", f"-I{REPO / 'spank'}",
         "-o", str(exe), str(REPO / "tests" / "contracts" / "envfile_harness.c")],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return exe


def _c(exe: Path, *args: str) -> str:
    res = subprocess.run([str(exe), *args], capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout.decode()


def _unhex(field: str) -> bytes:
    return b"" if field == "-" else bytes.fromhex(field)


def _private_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, 0o644)  # the plugin refuses a group or world writable file, whatever the umask


@needs_cc
@pytest.mark.parametrize("v", ENV["path"], ids=_id)
def test_c_env_file_path(c_reader: Path, v: dict[str, str]) -> None:
    assert _c(c_reader, "path", v["state_dir"], v["node"], v["job_id"]).strip() == v["path"]


@needs_cc
def test_c_node_names(c_reader: Path) -> None:
    for name, want in [(n, "1") for n in ENV["node_names"]["valid"]] + [(n, "0") for n in ENV["node_names"]["invalid"]]:
        assert _c(c_reader, "node", name).strip() == want, name


@needs_cc
@pytest.mark.parametrize("v", ENV["parse"], ids=_id)
def test_c_reads_env_files(c_reader: Path, v: dict[str, Any], tmp_path: Path) -> None:
    """The task env (every entry set in file order, so a later duplicate wins) and env_file_value,
    which slurmstepd uses as root, give the same values."""
    data, want = env_data(v), expected_env(v)
    state, job = tmp_path / "state", "42"
    file = state / "n1" / "jobs" / f"{job}.env"
    _private_file(file, data)
    out = _c(c_reader, "read", str(file))
    if want is None:
        assert out.strip() == "refused"
        assert _c(c_reader, "value", str(state), "n1", job, "A").strip() == "-1"
        return
    applied: dict[bytes, bytes] = {}
    for line in out.splitlines():
        key, value = line.split(" ")
        applied[_unhex(key)] = _unhex(value)
    assert applied == want
    for key in keys_mentioned(data):
        got = _c(c_reader, "value", str(state), "n1", job, key.decode()).split()
        if key in want:
            assert got[0] == "1" and _unhex(got[1]) == want[key], key
        else:
            assert got == ["0"], f"env_file_value finds {key!r}, which the task env does not get"


# ---------------------------------------------------------------------------------------------------
# Lua: etc/antman_job_submit.lua's tag reader and writer


def _lua_str(s: Optional[str]) -> str:
    if s is None:
        return "nil"
    # three-digit escapes of the UTF-8 bytes: a shorter one would swallow a digit that follows it
    return '"' + "".join(chr(b) if chr(b).isalnum() and b < 128 else f"\\{b:03d}" for b in s.encode()) + '"'


def _run_lua(body: str, tmp_path: Path) -> list[str]:
    """body runs with `antman` bound to etc/antman_job_submit.lua's module; one result per line."""
    script = tmp_path / "driver.lua"
    script.write_text(
        "slurm = { SUCCESS = 0, ERROR = -1, log_info = function() end, log_user = function() end, "
        "log_error = function() end, log_debug = function() end }\n"
        f"local antman = dofile({_lua_str(str(REPO / 'etc' / 'antman_job_submit.lua'))})\n"
        "local function show(v) if v == nil then print('nil') else print('=' .. v) end end\n" + body)
    res = subprocess.run([LUA, str(script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def _lua_shown(v: Optional[str]) -> str:
    return "nil" if v is None else "=" + v


@needs_lua
def test_lua_reads_the_class_field(tmp_path: Path) -> None:
    cases = ([(v["text"], v["class"]) for v in TAG["valid"]]
             + [(v["text"], v["class_field"]) for v in TAG["invalid"]]
             + [(t, None) for t in TAG["none"]])
    body = "".join(f"show(antman.tag_class({_lua_str(text)}))\n" for text, _ in cases)
    got = _run_lua(body, tmp_path)
    assert got == [_lua_shown(want) for _, want in cases]


def _lua_elastic(v: dict[str, Any]) -> str:
    return "{%d, %d}" % tuple(v["elastic"]) if "elastic" in v else "nil"


@needs_lua
def test_lua_writes_the_tags_of_submission(tmp_path: Path) -> None:
    cases = TAG["written_at_submission"]
    body = "".join(f"show(antman.render_tag({_lua_str(v['class'])}, {_lua_str(v['request'])}, {_lua_elastic(v)}))\n"
                   for v in cases)
    assert _run_lua(body, tmp_path) == ["=" + v["text"] for v in cases]


@needs_lua
def test_lua_reads_elastic_values(tmp_path: Path) -> None:
    """job_submit.lua's check of ANTMAN_ELASTIC from the job control env: the same values as the tag's."""
    cases = [(v["text"], f"{v['min']}:{v['max']}") for v in ELASTIC["valid"]] + [(t, None) for t in ELASTIC["invalid"]]
    body = ("local function range(v) local r = antman.parse_elastic(v) "
            "if r == nil then return nil end return r[1] .. ':' .. r[2] end\n"
            + "".join(f"show(range({_lua_str(text)}))\n" for text, _ in cases))
    assert _run_lua(body, tmp_path) == [_lua_shown(want) for _, want in cases]


# ---------------------------------------------------------------------------------------------------
# C: spank/args.c's --antman-elastic callback, compiled into tests/contracts/args_harness.c


@pytest.fixture(scope="module")
def c_args(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CC is None or not SPANK_H.exists():
        pytest.skip("a C compiler and Slurm's headers (libslurm-dev) are needed")
    exe = tmp_path_factory.mktemp("c-args") / "harness"
    res = subprocess.run(
        [CC, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wshadow", "-Wformat=2", f"-I{REPO / 'spank'}",
         "-o", str(exe), str(REPO / "tests" / "contracts" / "args_harness.c")],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return exe


@needs_cc
def test_c_reads_elastic_values(c_args: Path) -> None:
    for v in ELASTIC["valid"]:
        assert _c(c_args, "elastic", v["text"].encode().hex()).strip() == f"ok {v['min']}:{v['max']}", v
    for text in ELASTIC["invalid"]:
        res = subprocess.run([str(c_args), "elastic", text.encode().hex() or "-"], capture_output=True, timeout=30)
        assert res.returncode == 0 and res.stdout.decode().strip() == "refused", text
        assert b"--antman-elastic: invalid value '" in res.stderr, text


# ---------------------------------------------------------------------------------------------------
# Environment variable names: one constant per language, each equal to the spec


def _c_defines() -> dict[str, str]:
    return dict(re.findall(r'^#define (ANTMAN_ENV_\w+) "([^"]*)"', (REPO / "spank" / "common.h").read_text(), re.M))


def _string_literals_c(text: str) -> list[str]:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.findall(r'"((?:[^"\\\n]|\\.)*)"', text)


def test_names_in_python() -> None:
    names = {getattr(protocol, n) for n in dir(protocol) if n.startswith("ENV_")} | {protocol.ENDPOINT_ENV}
    assert names == ENV_NAMES


def test_names_in_c() -> None:
    defines = _c_defines()
    assert defines and set(defines.values()) <= ENV_NAMES
    assert len(set(defines.values())) == len(defines), "one name, one constant"
    # Elsewhere in the plugin a name is only ever the constant, never spelled out again.
    for src in sorted((REPO / "spank").glob("*.[ch]")):
        if src.name == "common.h":
            continue
        spelled = [s for s in _string_literals_c(src.read_text()) if s.rstrip("=") in ENV_NAMES]
        assert not spelled, f"{src.name} spells out {spelled}; use the ANTMAN_ENV_* constant of common.h"


LUA_MODULES = ("antman_job_submit.lua", "antman_cli_filter.lua", "antman_settings_loader.lua")


@pytest.mark.parametrize("module", LUA_MODULES)
def test_names_in_lua(module: str) -> None:
    text = (REPO / "etc" / module).read_text()
    code = re.sub(r"--\[\[.*?\]\]", "", text, flags=re.S)
    code = "\n".join(line.split("--", 1)[0] for line in code.splitlines())
    constants = dict(re.findall(r'^local (\w+_ENV) = "([^"]*)"', code, re.M))
    assert set(constants.values()) <= ENV_NAMES
    literals = re.findall(r'"((?:[^"\\\n]|\\.)*)"', code)
    spelled = [s for s in literals if s.rstrip("=") in ENV_NAMES]
    assert sorted(spelled) == sorted(constants.values()), f"{module} spells a name outside its constants"


# Files that may spell names out: the constants themselves, and the two start-up hooks that run in
# every Python of a job before anything of slurm_antman may be imported (they are compared below).
PY_OWNERS = {"slurm_antman/protocol/spec.py", "torch_patch/activation.py", "torch_patch/bundle_loader.py"}
# Job scripts stand for a user's own code, which reads the variables by name.
PY_USER_SCRIPTS = "slurm_antman/lab/jobs/"
# CUDA's variable, not ours: code may name it as CUDA documents it.
PY_FOREIGN = {protocol.ENV_CUDA_VISIBLE_DEVICES}


def _py_literals(path: Path) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def test_names_in_python_are_the_constants() -> None:
    offenders = {}
    for path in sorted([*(REPO / "slurm_antman").rglob("*.py"), *(REPO / "torch_patch").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel in PY_OWNERS or rel.startswith(PY_USER_SCRIPTS):
            continue
        ours = ENV_NAMES - PY_FOREIGN
        spelled = [s for s in _py_literals(path) if s in ours]
        # a job script embedded as a string reads the name from its source text, not as a literal
        spelled += [n for s in _py_literals(path) if "\n" in s for n in ours if f'"{n}"' in s]
        if spelled:
            offenders[rel] = spelled
    assert not offenders, f"use slurm_antman.protocol's constants: {offenders}"


def test_agent_start_up_copies() -> None:
    from torch_patch import activation

    assert set(activation.ACTIVATION_ENV) == {protocol.ENV_JOB_ID, protocol.ENV_CLASS}
    assert activation.DISABLE_ENV == protocol.ENV_AGENT_DISABLE
    spelled = {s for s in _py_literals(REPO / "torch_patch" / "bundle_loader.py") if s.startswith("ANTMAN_")}
    assert spelled == set(activation.ACTIVATION_ENV)


@pytest.mark.parametrize("path", ["docs/protocol.md", "docs/architecture.md"])
def test_docs_name_only_known_variables(path: str) -> None:
    named = set(re.findall(r"`((?:SLURM_SPANK_|SPANK_)?ANTMAN_[A-Z_]+)`", (REPO / path).read_text()))
    assert named, path
    assert named <= ENV_NAMES, f"{path} names {sorted(named - ENV_NAMES)}, not in docs/contracts.json"
