"""The house rules of the source tree, read from the code itself: which room may import which, where
Slurm is run, and how big a room may grow. docs/architecture.md ("The map") says why each rule holds.

A room is a package of one idea (``slurm_antman.sidecar``, ``slurm_antman.policy.cluster``,
``slurm_antman.lab.devcluster``, ...) or a module at the top of ``slurm_antman``. Imports inside functions
count: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("slurm_antman", "torch_patch")

# Rooms deeper than slurm_antman.X: packages whose subpackages each hold an idea of their own.
NESTED = ("slurm_antman.policy", "slurm_antman.lab")
# The daemons and the in-job agent: separate processes that share only the protocol, the config
# model and what sits below them. None may import another.
DAEMONS = ("slurm_antman.sidecar", "slurm_antman.coordinator", "torch_patch")
# Product code never imports the lab (devcluster, demo, benchmarks, evaluation), except the command
# line that dispatches `antman bench|demo|devcluster` to it.
LAB = "slurm_antman.lab"
LAB_DISPATCHERS = ("slurm_antman.cli",)
# What the pure policy cores may import: nothing that does I/O or reads a clock.
PURE_STDLIB = {"__future__", "dataclasses", "typing", "types", "math", "enum", "collections", "itertools",
               "functools", "re", "heapq", "bisect", "statistics", "operator"}
POLICY = "slurm_antman.policy"
# Slurm's commands; only slurm_antman/slurm/ (the adapter) and the lab run them.
SLURM_COMMANDS = {"scontrol", "squeue", "sinfo", "sacct", "sacctmgr", "sbatch", "srun", "salloc", "scancel",
                  "sreport", "sstat", "sprio", "sshare", "strigger", "sattach", "sdiag", "slurmctld", "slurmd",
                  "slurmdbd"}
SLURM_DOOR = ("slurm_antman.slurm", LAB)
# A module over this many lines must say here why it is still one idea.
MAX_LINES = 600
ONE_IDEA_OVER_MAX: dict[str, str] = {
    "slurm_antman.config.model": "the antman.yaml schema: one model per section, each field with the description "
                                 "`antman config reference` prints and docs/admin.md shows; split, a field's "
                                 "section and its neighbours would lie apart",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            # Job scripts the lab submits are programs, not modules of the package.
            if "lab/jobs/" in path.as_posix() and path.name != "__init__.py":
                continue
            out[_module_name(path)] = path
    return out


MODULES = _modules()


def _imported(module: str, path: Path, tree: ast.AST) -> set[str]:
    """The modules of PACKAGES that ``module`` imports (``from P import name`` counts as P.name when that is
    a module, else as P)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES and "." in t:
                t = t.rpartition(".")[0]
            if t in MODULES and t != module:
                found.add(t)
    return found


def _trees() -> dict[str, ast.AST]:
    return {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


TREES = _trees()
GRAPH = {m: _imported(m, MODULES[m], TREES[m]) for m in MODULES}


def room(module: str) -> str:
    for nested in NESTED:
        if module == nested or module.startswith(nested + "."):
            depth = nested.count(".") + 2
            return ".".join(module.split(".")[:depth])
    parts = module.split(".")
    if parts[0] != "slurm_antman":
        return parts[0]
    if len(parts) == 1:
        return module
    # A top-level module is a room of its own; a package is one room with its submodules.
    top = ".".join(parts[:2])
    return top


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _room_graph() -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        r = room(m)
        rooms.setdefault(r, set())
        for d in deps:
            if room(d) != r:
                rooms[r].add(room(d))
    return rooms


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    assert _cycles(GRAPH) == []


def test_no_two_rooms_import_each_other():
    cycles = _cycles(_room_graph())
    detail = {r: sorted(d for d in _room_graph()[r] if d in c) for c in cycles for r in c}
    assert cycles == [], detail


def test_no_daemon_imports_another_daemon():
    bad = sorted((m, d) for m, deps in GRAPH.items() for d in deps
                 if room(m) in DAEMONS and room(d) in DAEMONS and room(d) != room(m))
    assert bad == []


def test_product_code_never_imports_the_lab():
    bad = sorted((m, d) for m, deps in GRAPH.items() for d in deps
                 if not m.startswith(LAB) and m not in LAB_DISPATCHERS and d.startswith(LAB))
    assert bad == []


def _external_imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add((node.module or "").split(".")[0])
    return out - set(PACKAGES)


def test_the_policy_cores_are_pure():
    """No I/O and no clock: the daemons and the simulator must be able to run the same decisions."""
    found = {m: sorted(_external_imports(TREES[m]) - PURE_STDLIB) for m in MODULES if m.startswith(POLICY)}
    assert {m: v for m, v in found.items() if v} == {}
    outside = sorted((m, d) for m, deps in GRAPH.items() if m.startswith(POLICY) for d in deps
                     if not d.startswith(POLICY))
    assert outside == []


def _runs_slurm(tree: ast.AST) -> list[tuple[int, str]]:
    """Argument lists that start with a Slurm command (``["scontrol", ...]``, or a string that starts with
    one and a space, as a shell command), and ``shutil.which("scontrol")``-style lookups."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value in SLURM_COMMANDS:
                hits.append((node.lineno, first.value))
        elif isinstance(node, ast.Call) and _callee(node) in RUNNERS:
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if arg.value.split(" ", 1)[0] in SLURM_COMMANDS:
                        hits.append((node.lineno, arg.value))
    return hits


# Calls that run (or find, to run) a program named by their first argument.
RUNNERS = {"run", "Popen", "check_output", "check_call", "call", "system", "which", "execvp", "execv", "_run"}


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def test_the_slurm_finder_finds_a_slurm_call():
    tree = ast.parse('subprocess.run(["scontrol", "show", "job"])\nshutil.which("sbatch")\nprint("squeue")')
    assert sorted(h[1] for h in _runs_slurm(tree)) == ["sbatch", "scontrol"]


def test_only_the_slurm_adapter_runs_slurm_commands():
    """Every Slurm call goes through slurm_antman/slurm/ (its parsers, its typed errors); the lab may run
    Slurm itself, since it stands up and drives a whole cluster."""
    bad = {m: _runs_slurm(TREES[m]) for m in MODULES
           if m.startswith("slurm_antman") and not m.startswith(SLURM_DOOR)}
    assert {m: h for m, h in bad.items() if h} == {}


def test_no_big_module_holds_more_than_one_idea():
    sizes = {m: len(MODULES[m].read_text().splitlines()) for m in MODULES}
    over = sorted(m for m, n in sizes.items() if n > MAX_LINES and m not in ONE_IDEA_OVER_MAX)
    assert over == [], {m: sizes[m] for m in over}
    # An exemption outlives its reason when the module shrinks or goes.
    stale = sorted(m for m in ONE_IDEA_OVER_MAX if m not in sizes or sizes[m] <= MAX_LINES)
    assert stale == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("slurm_antman.policy")))
def test_policy_modules_import_without_third_party_packages(module):
    """The policy imports in a Python with nothing but the standard library on its path."""
    import subprocess

    code = (f"import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
            f"sys.path.insert(0, {str(REPO)!r}); import {module}")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
