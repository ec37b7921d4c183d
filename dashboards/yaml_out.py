"""A minimal block-style YAML writer for the plain dicts, lists and strings of the rule file.

PyYAML is no dependency of the project; this writes just what ``alerts.yml`` holds.
A string is left plain when YAML reads it back as that same string (a name or a
duration such as ``5m``), written as a ``|-`` block when it has line breaks, and
double-quoted (JSON's quoting, valid YAML) otherwise; numbers, booleans and null
as JSON writes them. An empty dict or list is written inline (``{}``, ``[]``).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["lines"]

_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_DURATION = re.compile(r"[0-9]+[smhdwy]\Z")
_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n"}


def lines(value: Any, indent: str = "") -> list[str]:
    """The lines of ``value`` in block style, each prefixed by ``indent``."""
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{indent}{k}:")
                out.extend(lines(v, indent + "  "))
            else:
                out.append(f"{indent}{k}: {_scalar(v, indent)}")
    elif isinstance(value, list):
        for item in value:
            sub = lines(item, indent + "  ")
            out.append(f"{indent}- {sub[0].lstrip()}")
            out.extend(sub[1:])
    else:
        out.append(f"{indent}{_scalar(value, indent)}")
    return out


def _scalar(value: Any, indent: str) -> str:
    if isinstance(value, str) and "\n" in value:
        body = "\n".join(f"{indent}  {line}" if line else "" for line in value.split("\n"))
        return f"|-\n{body}"
    if isinstance(value, str) and (_PLAIN.match(value) or _DURATION.match(value)) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)  # a JSON string is a valid YAML double-quoted scalar
