"""Reading ``antman.yaml`` into the model (model.py), strictly: a YAML that would mean something else to
another reader (duplicate keys, YAML 1.1 booleans, numbers YAML respells) is refused, and every error names
the field (as a dotted path into the YAML), its line, and what is allowed, because the person reading
it is an admin editing a file, not a Python developer."""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Optional

import yaml
from pydantic import ValidationError

from ..errors import AntmanError
from .model import AntmanConfig


class ConfigError(AntmanError):
    """A config file that cannot be used; ``problems`` lists ``(field path, message)``; ``lines`` holds,
    for each problem, the line of the file it is on (None where there is no file or no single line)."""

    def __init__(self, source: str, problems: list[tuple[str, str]], lines: Optional[list[Optional[int]]] = None):
        self.source = source
        self.problems = problems
        self.lines = list(lines) if lines is not None else [None] * len(problems)
        text = "\n".join(f"  {'' if line is None else f'line {line}: '}{path}: {msg}"
                         for (path, msg), line in zip(problems, self.lines))
        super().__init__(f"{source}: invalid configuration\n{text}")


def _what(v: object) -> str:
    """A value as the admin wrote it in YAML, with the kind YAML made of it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({'true' if v else 'false'})"
    if isinstance(v, (int, float)):
        return f"a number ({v!r})"
    if isinstance(v, str):
        return f"a string ({v!r})"
    if isinstance(v, (datetime.date, datetime.datetime)):
        return f"a date ({v.isoformat()})"
    if isinstance(v, (list, tuple)):
        return "a list"
    if isinstance(v, dict):
        return "a mapping"
    return type(v).__name__

_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "list_type": "a list", "model_type": "a mapping of fields",
             "dict_type": "a mapping of fields"}


def _describe(err: dict) -> tuple[str, str]:
    path = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field (check the spelling; see docs/admin.md for the fields)"
    elif err["type"] == "enum":
        msg = f"{err.get('input')!r} is not allowed; allowed: {err['ctx']['expected']}"
    elif err["type"] == "string_pattern_mismatch" and path.endswith("telemetry"):
        msg = f"{err.get('input')!r} is not allowed; allowed: 'auto', 'nvml', 'emulated'"
    elif err["type"] in _EXPECTED:
        got = err.get("input")
        msg = f"expected {_EXPECTED[err['type']]}, got {_what(got)}"
        if err["type"] == "string_type" and isinstance(got, (bool, int, float)):
            msg += "; quote it if you mean that text"
    return path, msg


def _lookup(root: Optional[yaml.Node], loc: tuple) -> Optional[int]:
    """The line (1-based) of the file where the field at ``loc`` is written: its key's line in a mapping,
    the item's line in a list; where the field is missing, the line of the mapping it belongs in. None
    without a file, or when the mapping is the document itself (no line says more than the file name)."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            # Searched from the end: after a merge (<<) the later key is the one that wins, as in the dict.
            hit = next(((k, v) for k, v in reversed(node.value)
                        if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
            if hit is None:
                break
            line, node = hit[0].start_mark.line + 1, hit[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _validate(data: object, source: str, root: Optional[yaml.Node] = None) -> AntmanConfig:
    if not isinstance(data, dict):
        raise ConfigError(source, [("(top level)", "expected a mapping of fields")])
    try:
        return AntmanConfig.model_validate(data)
    except ValidationError as e:
        errs = e.errors()
        if root is not None:  # in the file's order, as the admin reads it
            errs.sort(key=lambda err: _lookup(root, tuple(err["loc"])) or 0)
        raise ConfigError(source, [_describe(err) for err in errs],
                          [_lookup(root, tuple(err["loc"])) for err in errs]) from None


def parse(data: object, source: str = "<config>") -> AntmanConfig:
    return _validate(data, source)


# A real antman.yaml is a few kB; its size and shape are bounded before anything walks it (an alias
# bomb is small on disk and huge once expanded; deep nesting exhausts the recursion).
MAX_CONFIG_BYTES = 1 << 20

MAX_CONFIG_NODES = 100_000


def _expanded_size(node: yaml.Node, budget: int) -> int:
    """YAML nodes ``node`` stands for once every alias is expanded, counting no further than ``budget``."""
    seen, stack = 0, [node]
    while stack:
        n = stack.pop()
        seen += 1
        if seen > budget:
            return seen
        if isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
        elif isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack.extend((k, v))
    return seen

_MERGE = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, minus what it decides silently: a key given twice in one mapping (the last
    one wins), YAML 1.1's other booleans (yes/no/on/off: `query_endpoint: off` is False, not 'off'),
    and its integer and float spellings that change the number (010 is 8, 1:30 is 90, 1_000 is 1000).
    Each is collected in ``problems`` as (node, message) and loading goes on, so that one run of
    `antman config check` lists them all."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()
        self.problems: list[tuple[yaml.Node, str]] = []

    def flatten_mapping(self, node):
        # Every mapping passes through here before its merge keys are folded in, so its own keys are
        # still as written; merged keys may be overridden, which is what << is for.
        if id(node) not in self._checked:
            self._checked.add(id(node))
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                try:
                    earlier = first.get(key)
                except TypeError:  # unhashable: SafeLoader reports it
                    continue
                if earlier is not None:
                    self.problems.append((key_node, f"duplicate key {key_node.value!r} (first at line "
                                                    f"{earlier.start_mark.line + 1})"))
                else:
                    first[key] = key_node
        super().flatten_mapping(node)

    def construct_strict_bool(self, node):
        if node.value.lower() not in ("true", "false"):
            meant = "true" if self.bool_values[node.value.lower()] else "false"
            self.problems.append((node, f"YAML 1.1 reads {node.value!r} as the boolean {meant}; write true or "
                                        f"false, or quote it ('{node.value}') if you mean that text"))
        return self.construct_yaml_bool(node)

    def construct_strict_int(self, node):
        value = self.construct_yaml_int(node)
        if not re.fullmatch(r"[-+]?(0|[1-9][0-9]*)", node.value):
            self.problems.append((node, f"YAML reads {node.value!r} as {value}; write it in plain decimal digits, "
                                        f"or quote it if you mean that text"))
        return value

    def construct_strict_float(self, node):
        value = self.construct_yaml_float(node)
        if "_" in node.value or ":" in node.value:
            self.problems.append((node, f"YAML reads {node.value!r} as {value}; write it as a plain decimal "
                                        f"number, or quote it if you mean that text"))
        return value


def _path_of(root: yaml.Node, target: yaml.Node) -> Optional[str]:
    """The dotted field path of ``target`` (a key or a value) in the tree under ``root``."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if node is target:
            return ".".join(str(p) for p in path) or "(top level)"
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*path, i)) for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else "?"
                if k is target:
                    return ".".join(str(p) for p in (*path, name))
                stack.append((v, (*path, name)))
    return None


def load(path: str | Path) -> AntmanConfig:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(str(path), [("(file)", e.strerror or str(e))]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(str(path), [("(file)", f"larger than {MAX_CONFIG_BYTES} bytes; not an antman.yaml")])
    node = None
    try:
        text = raw.decode()
        loader = _StrictLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None and _expanded_size(node, MAX_CONFIG_NODES) > MAX_CONFIG_NODES:
                raise ConfigError(str(path), [("(file)", f"more than {MAX_CONFIG_NODES} values once its aliases "
                                                         "are expanded; not an antman.yaml (an alias bomb?)")])
            data = loader.construct_document(node) if node is not None else None
            found = sorted(loader.problems, key=lambda p: (p[0].start_mark.line, p[0].start_mark.column))
        finally:
            loader.dispose()
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), [("(file)", f"not UTF-8 text: {e.reason} at byte {e.start}")]) from None
    except RecursionError:
        raise ConfigError(str(path), [("(file)", "nested too deeply; not an antman.yaml")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        raise ConfigError(str(path), [(where, f"not valid YAML: {getattr(e, 'problem', e)}")]) from None
    if found:
        # Validating what YAML made of these would only repeat them in other words.
        raise ConfigError(str(path), [(_path_of(node, n) or "(file)", msg) for n, msg in found],
                          [n.start_mark.line + 1 for n, _ in found])
    try:
        return _validate(data, str(path), node)
    except RecursionError:
        raise ConfigError(str(path), [("(file)", "nested too deeply; not an antman.yaml")]) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:bool", _StrictLoader.construct_strict_bool)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_strict_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_strict_float)
