"""Every configuration key with its type, default, unit, allowed values and meaning, read
from the code that defines them, so that ``ccld config --explain`` and the configuration
reference (docs/reference/configuration.md) cannot drift from it.

The meaning is the string literal under each field of the config dataclasses
(:mod:`ccld_plugin.config`), read from their source; what is allowed, the ``allowed``
argument of the ``_check`` and ``_seconds`` calls that validate the key; the unit, the
name's suffix (``_s`` seconds, ``_ms`` milliseconds, ``_steps`` steps).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import textwrap
import typing
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ccld_plugin import config
from ccld_plugin.config_values import ConfigError, shown

__all__ = ["ConfigKey", "ConfigSection", "config_keys", "config_sections", "explain"]

UNITS = {"_s": "seconds", "_ms": "milliseconds", "_steps": "steps"}
CHECKS = {"_check": (1, 3), "_seconds": (0, 3)}  # helper: (index of the key, of the allowed)
WIDTH = 88  # of ``--explain``'s text


@dataclass(frozen=True, slots=True)
class ConfigKey:
    key: str  # dotted: diagnoser.hang_min_s
    type: str  # bool, int, float, str, str | None
    default: Any
    unit: str  # seconds, milliseconds, steps, or ""
    allowed: str  # what validation accepts
    doc: str  # the documentation under the field ("" when it has none)

    @property
    def default_shown(self) -> str:
        """The default as a YAML file writes it."""
        return yaml_value(self.default)


@dataclass(frozen=True, slots=True)
class ConfigSection:
    key: str  # dotted, "" for the top level
    doc: str  # the section class's docstring
    keys: tuple[ConfigKey, ...]  # its own keys (not those of its subsections)


def yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return json.dumps(value) if isinstance(value, str) else str(value)


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each annotated field of a class, by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for stmt, following in zip(body, body[1:] + [None], strict=True):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            text = " ".join(inspect.cleandoc(following.value.value).split())
            docs[stmt.target.id] = text.replace("``", "`")  # Markdown's code spans
    return docs


def _text(node: ast.expr, module: ModuleType) -> str | None:
    """A string literal or f-string of ``module`` whose fields are its module constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if not isinstance(node, ast.JoinedStr):
        return None
    out = []
    for part in node.values:
        if isinstance(part, ast.Constant):
            out.append(str(part.value))
        elif (
            isinstance(part, ast.FormattedValue)
            and isinstance(part.value, ast.Name)
            and hasattr(module, part.value.id)
        ):
            spec = _text(part.format_spec, module) if part.format_spec else ""
            out.append(format(getattr(module, part.value.id), spec or ""))
        else:
            return None
    return "".join(out)


def _allowed(module: ModuleType) -> dict[str, list[str]]:
    """What each key's checks accept, from the ``allowed`` argument of every check of it."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        where = CHECKS.get(node.func.id)
        if where is None or len(node.args) <= max(where):
            continue
        key, allowed = (_text(node.args[i], module) for i in where)
        if key and allowed:
            if node.func.id == "_seconds":
                allowed += f", at most {module.DAY_S:g}"
            found.setdefault(key, []).append(allowed)
    return found


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return f"{args[0].__name__} | None" if args else tp.__name__


def _unit(name: str) -> str:
    return next((unit for suffix, unit in UNITS.items() if name.endswith(suffix)), "")


def _when_unchecked(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = {bool: "true or false", str: "text"}.get(args[0] if args else tp, "")
    return base + (" or null" if args else "")


@functools.cache  # the source it reads does not change while the process runs
def config_sections() -> tuple[ConfigSection, ...]:
    """The config tree's sections, the top level first, each with its own keys."""
    allowed = _allowed(config)
    out: list[ConfigSection] = []

    def walk(cls: type, prefix: str) -> None:
        docs, hints = _field_docs(cls), typing.get_type_hints(cls)
        keys: list[ConfigKey] = []
        subsections: list[tuple[type, str]] = []
        instance = cls()
        for f in dataclasses.fields(cls):
            key, tp = prefix + f.name, hints[f.name]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                subsections.append((tp, key + "."))
                continue
            checks = allowed.get(key) or [_when_unchecked(tp)]
            keys.append(
                ConfigKey(
                    key=key,
                    type=_type_name(tp),
                    default=getattr(instance, f.name),
                    unit=_unit(f.name),
                    allowed="; ".join(checks),
                    doc=docs.get(f.name, ""),
                )
            )
        doc = (inspect.getdoc(cls) or "").replace("``", "`")
        out.append(ConfigSection(prefix.rstrip("."), doc, tuple(keys)))
        for tp, sub in subsections:
            walk(tp, sub)

    walk(config.CcldConfig, "")
    return tuple(out)


def config_keys() -> list[ConfigKey]:
    """Every key of the config, in the order of the tree."""
    return [k for s in config_sections() for k in s.keys]


def explain(key: str | None = None) -> str:
    """The documentation of ``key``, of every key under a section ``key``, or of all keys;
    a key that does not exist is a :class:`ConfigError` naming the nearest ones."""
    keys = config_keys()
    chosen = [
        k for k in keys if key is None or k.key == key or k.key.startswith(key.rstrip(".") + ".")
    ]
    if not chosen:
        near = difflib.get_close_matches(str(key), [k.key for k in keys], n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        raise ConfigError(
            f"ccld config: no key {shown(key)}; {hint}ccld config --explain lists every key"
        )
    return "\n\n".join(_explained(k) for k in chosen) + "\n"


def _explained(k: ConfigKey) -> str:
    unit = f", {k.unit}" if k.unit else ""
    lines = [f"{k.key}  ({k.type}{unit}; default {k.default_shown})"]
    for text in (k.doc or "(no documentation)", f"Allowed: {k.allowed}."):
        lines += textwrap.wrap(text, WIDTH, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)
