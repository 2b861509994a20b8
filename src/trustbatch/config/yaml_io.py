"""Reading configuration YAML: safe, with ``3e-1``-style floats, one-line errors for unreadable files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-1``, ``1e4``, ``-2E+3`` as floats, and refuses a key given twice in one
    mapping.

    YAML 1.1 (PyYAML) needs a dot in a float, so ``{eps_high: 3e-1}`` would be the string
    ``'3e-1'``; typed fields coerce it back, free-form dicts (objective.options) do not. PyYAML keeps the last of
    two equal keys, so a section written twice (``train:`` at the top and again further down) silently lost the
    first one's settings.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    if key_node.value in seen:
                        raise yaml.constructor.ConstructorError(
                            "while reading a mapping", node.start_mark,
                            f"found the key {key_node.value!r} twice (first at line {seen[key_node.value] + 1}); give "
                            "it once", key_node.start_mark)
                    seen[key_node.value] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings ``_Loader`` reads as floats (``'1e5'``): a dumped config reads back as it
    was (a run_dir or system prompt ``1e5`` came back as 100000.0, and its resume was refused)."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def yaml_dumps(data: Any, **kwargs) -> str:
    """``yaml.safe_dump(data, **kwargs)`` that ``yaml_loads`` reads back equal (see ``_Dumper``)."""
    return yaml.dump(data, Dumper=_Dumper, **kwargs)


class YamlBool(str):
    """A YAML 1.1 boolean (``on``, ``off``, ``yes``, ``no``, ``true``, ``false`` in any case) as the user typed it.

    ``load_config`` reads values with these kept, so that a key whose values are words gets the word
    (``data.chat_template=on``) and a refusal quotes what was typed; ``value`` is YAML's reading, which a boolean
    key gets (``Config``'s sections convert every one before validation). Never truth-test one: ``bool(YamlBool("off"))``
    is True, as for any non-empty string.
    """

    @property
    def value(self) -> bool:
        return self.lower() in ("yes", "true", "on")


class _WordLoader(_Loader):
    """``_Loader`` that gives ``YamlBool`` for YAML's boolean words."""


_WordLoader.add_constructor("tag:yaml.org,2002:bool", lambda loader, node: YamlBool(loader.construct_scalar(node)))


def yaml_loads(text: str, words: bool = False) -> Any:
    """Parse YAML text as configs are parsed: safe, with ``3e-1``-style floats (see ``_Loader``); ``words``: YAML's
    booleans as ``YamlBool`` (the typed word), for ``load_config``.

    Raises:
        yaml.YAMLError: the text is not valid YAML.
    """
    return yaml.load(text, Loader=_WordLoader if words else _Loader)  # noqa: S506 - both are SafeLoaders


def read_yaml_file(path: str | Path, what: str = "config file", words: bool = False) -> Any:
    """Read and parse a YAML file (UTF-8) with ``yaml_loads`` (``words`` as there).

    Raises:
        UserError: the file is missing, not UTF-8 (names the line) or not valid YAML.
    """
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{what} {str(p)!r} is a folder, not a file; give a YAML file")
    if not p.is_file():
        raise UserError(f"{what} {str(p)!r} does not exist")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{what} {str(p)!r} line {line} is not UTF-8 (byte 0x{raw[e.start]:02x}); "
                        "save the file as UTF-8") from None
    try:
        return yaml_loads(text, words)
    except yaml.YAMLError as e:
        raise UserError(f"{what} {str(p)!r} is not valid YAML: {yaml_error_line(e)}; fix that line") from None


def yaml_error_line(e: yaml.YAMLError) -> str:
    """PyYAML's error in one line: where (line and column, from 1) and what it found, e.g. "line 2, column 9: while
    parsing a flow sequence, expected ',' or ']', but got '<stream end>'" (its message is several lines)."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    said = ", ".join(" ".join(str(x).split()) for x in parts if x)
    return where + (said or str(e).splitlines()[0])
