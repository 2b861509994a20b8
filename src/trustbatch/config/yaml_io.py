"""Reading configuration YAML: safe, with ``3e-1``-style floats, one-line errors for unreadable files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-1``, ``1e4``, ``-2E+3`` as floats.

    YAML 1.1 (PyYAML) needs a dot in a float, so ``{eps_high: 3e-1}`` would be the string
    ``'3e-1'``; typed fields coerce it back, free-form dicts (objective.options) do not.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_loads(text: str) -> Any:
    """Parse YAML text as configs are parsed: safe, with ``3e-1``-style floats (see ``_Loader``).

    Raises:
        yaml.YAMLError: the text is not valid YAML.
    """
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def read_yaml_file(path: str | Path, what: str = "config file") -> Any:
    """Read and parse a YAML file (UTF-8) with ``yaml_loads``.

    Raises:
        UserError: the file is missing, not UTF-8 (names the line) or not valid YAML.
    """
    p = Path(path)
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
        return yaml_loads(text)
    except yaml.YAMLError as e:
        raise UserError(f"{what} {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
