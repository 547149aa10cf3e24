"""Configuration input read as the schema's own types, strictly.

A YAML file (from its nodes: the text of each scalar as written), ``KEY=VALUE`` overrides
(the text after ``=``) and mappings (a DeepSpeed block, JSON) become plain nested dicts of
bool, int, float, str and None, one per source, with every key known to the schema. Nothing
is coerced: YAML 1.1's yes/on booleans, octal, hex and sexagesimal numbers, a number where
text goes (``job=007`` is the text ``007``), a number or a word where a boolean goes, and
omegaconf's ``${...}`` interpolation are each refused with one line that names the key.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from collections.abc import Mapping
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ["ConfigError", "cut", "problem", "read_mapping", "read_override", "read_yaml", "shown"]

SHOWN_CHARS = 80  # of a value in an error line: a value can be 100,000 characters long
MAX_DIGITS = 4000  # Python refuses to convert longer numbers (sys.int_info)
INTEGER = re.compile(r"[-+]?[0-9]+", re.ASCII)
DECIMAL = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", re.ASCII)
NON_FINITE = re.compile(r"[-+]?\.?(?:inf|nan)", re.ASCII | re.IGNORECASE)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
BOOL_WORDS = ("true", "True", "TRUE", "false", "False", "FALSE")  # YAML 1.2's, nothing else
BOOL_TAG, NULL_TAG, STR_TAG = (f"tag:yaml.org,2002:{t}" for t in ("bool", "null", "str"))
MAP_TAG = "tag:yaml.org,2002:map"
EXPECTED = {
    bool: "true or false",
    int: "a whole number in decimal digits, e.g. 64",
    float: "a number, e.g. 30 or 2.5",
    str: "text",
}
PATH_KEYS = {"dir", "jsonl", "record"}
MISSING = "???"  # omegaconf's marker of a value to be given later: it cannot hold it as text
_IMPLICIT = yaml.resolver.Resolver()  # YAML's own reading of a plain scalar


class ConfigError(ValueError):
    """A bad configuration key or value; the message is one line and names the fix."""


def shown(value: object) -> str:
    """A value as an error line shows it: its repr, so that newlines and other control
    characters are escaped, cut after SHOWN_CHARS characters with a marker that says so."""
    if isinstance(value, int) and value.bit_length() > 128:  # its repr may be refused
        return f"<a whole number of about {int(value.bit_length() * 0.30103) + 1} digits>"
    if isinstance(value, Mapping | list | tuple):  # repr of a structure: anything, any size
        return f"<a {'mapping' if isinstance(value, Mapping) else 'list'}>"
    length = len(value) if isinstance(value, str) else None
    text = repr(value[: SHOWN_CHARS + 1] if isinstance(value, str) else value)
    if len(text) <= SHOWN_CHARS and (length is None or length <= SHOWN_CHARS):
        return text
    return f"{text[:SHOWN_CHARS]}...[cut: {length or len(text)} characters]"


def cut(text: str) -> str:
    """Text from the user inside an error line's prose (a path): control characters
    escaped, cut after SHOWN_CHARS characters with a marker that says so."""
    line = text if text.isprintable() else repr(text)[1:-1]
    return (
        line
        if len(line) <= SHOWN_CHARS
        else f"{line[:SHOWN_CHARS]}...[cut: {len(text)} characters]"
    )


# ------------------------------------------------------------------------------- schema
@functools.cache
def _hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _leaf(tp: Any) -> tuple[type, bool]:
    """The type of a key's value and whether it may be null (``str | None``)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (args[0], True) if args else (tp, False)


def _unknown(key: str, schema: type) -> ConfigError:
    allowed = ", ".join(sorted(_hints(schema)))
    return ConfigError(f"ccld config: unknown key {shown(key)}; allowed keys here: {allowed}")


def _not_a_section(key: str, schema: type, value: str) -> ConfigError:
    keys = ", ".join(_hints(schema))
    return ConfigError(
        f"ccld config: {key}={value} is not allowed; {key} is a section: give its keys "
        f"({keys}), e.g. {key}.{next(iter(_hints(schema)))}=..."
    )


# ----------------------------------------------------------------------- one value each
def _refused(key: str, value: object, base: type, optional: bool) -> ConfigError:
    null = " or null" if optional else ""
    return ConfigError(
        f"ccld config: {key}={shown(value)} is not allowed; expected {EXPECTED[base]}{null}"
    )


def _refuse_interpolation(key: str, value: object) -> None:
    """omegaconf would resolve ``${...}`` (an environment variable, another key) when the
    config is built, and a post-mortem would read what a job folder's file points at."""
    if isinstance(value, str) and "${" in value:
        raise ConfigError(
            f"ccld config: {key}={shown(value)}: interpolation (${{...}}) is not supported; "
            "write the value itself"
        )


def _text(key: str, text: str) -> str:
    """Text as given, once it holds nothing omegaconf would read as something else."""
    if CONTROL.search(text):
        raise ConfigError(
            f"ccld config: {key}={shown(text)} is not allowed; expected text on one line, "
            "without control characters"
        )
    if text == MISSING:
        raise ConfigError(
            f"ccld config: {key}={shown(text)} is not allowed; {MISSING} marks a missing value "
            "in omegaconf: write the value itself"
        )
    return text


def _flag_as_text(key: str, value: object, optional: bool) -> ConfigError:
    """A yes/no where the config takes text (a path, a name): a file named ``True`` in the
    working folder is never what was meant."""
    name = key.rsplit(".", 1)[-1]
    off = " or null (off)" if optional else ""
    what = f"a path{off}, e.g. /tmp/ccld/{name}" if name in PATH_KEYS else f"text{off}"
    return ConfigError(
        f"ccld config: {key}={shown(value)} reads as yes/no; expected {what} "
        "(quote text that looks like yes/no)"
    )


def _out_of_range(key: str, value: object) -> ConfigError:
    return ConfigError(f"ccld config: {key}={shown(value)} is not allowed; it is out of range")


def _written_value(key: str, tp: Any, text: str, quoted: bool) -> Any:
    """The value of ``text`` written for a key of type ``tp``: quoted text is text; plain
    text is text, null or yes/no as YAML reads it, a number only in decimal digits."""
    base, optional = _leaf(tp)
    _refuse_interpolation(key, text)
    if quoted:
        if base is str:
            return _text(key, text)
        raise _refused(key, text, base, optional)
    tag = _IMPLICIT.resolve(ScalarNode, text, (True, False))
    if tag == NULL_TAG and optional:
        return None
    if base is str:
        if tag == BOOL_TAG:
            raise _flag_as_text(key, text, optional)
        if tag == NULL_TAG:
            raise _refused(key, text, base, optional)
        return _text(key, text)
    word = text.strip()  # around a number or a yes/no, spaces say nothing
    if base is bool and word in BOOL_WORDS:
        return word.lower() == "true"
    if base is int and INTEGER.fullmatch(word):
        return _whole(key, word)
    if base is float and DECIMAL.fullmatch(word):
        return float(word)
    if base is float and NON_FINITE.fullmatch(word):
        return float(word.replace(".", ""))  # refused by the key's range, which names it
    raise _refused(key, text, base, optional)


def _whole(key: str, digits: str) -> int:
    if len(digits) > MAX_DIGITS:
        raise _out_of_range(key, digits)
    return int(digits)


def _given_value(key: str, tp: Any, value: object) -> Any:
    """A value of a mapping: of the key's type already (an int for a float key too)."""
    base, optional = _leaf(tp)
    _refuse_interpolation(key, value)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if value is None and optional:
        return None
    if base is str and isinstance(value, bool):
        raise _flag_as_text(key, value, optional)
    if base is str and isinstance(value, str):
        return _text(key, value)
    if (
        base is bool
        and isinstance(value, bool)
        or base is int
        and number
        and isinstance(value, int)
    ):
        return value
    if base is float and number:
        try:
            return float(typing.cast(float, value))
        except OverflowError:  # an int beyond any float
            raise _out_of_range(key, value) from None
    raise _refused(key, value, base, optional)


# ---------------------------------------------------------------------------- sources
def read_mapping(values: Mapping[Any, Any], schema: type, prefix: str = "") -> dict[str, Any]:
    """The values of a mapping (nested as the schema's sections), checked key by key."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        tp = _hints(schema).get(name) if isinstance(name, str) else None
        if tp is None:
            raise _unknown(key if isinstance(name, str) else f"{prefix}{shown(name)}", schema)
        if not _is_section(tp):
            out[name] = _given_value(key, tp, value)
        elif isinstance(value, Mapping):
            out[name] = read_mapping(value, tp, f"{key}.")
        else:
            raise _not_a_section(key, tp, shown(value))
    return out


def read_override(item: object, schema: type) -> dict[str, Any]:
    """One ``KEY=VALUE`` override as a nested dict; the value is the text after the first
    ``=``, as written (quotes, when it is in them, are taken off: ``job='007'``)."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"ccld config: override {shown(item)} must look like KEY=VALUE")
    key, text = item.split("=", 1)
    names = key.split(".")
    tp: Any = schema
    for depth, name in enumerate(names):
        if not _is_section(tp) or name not in _hints(tp):
            where = ".".join(names[:depth])
            if not _is_section(tp):
                raise ConfigError(f"ccld config: unknown key {shown(key)}; {where} has no keys")
            raise _unknown(key, tp)
        tp = _hints(tp)[name]
    if _is_section(tp):
        raise _not_a_section(key, tp, shown(text))
    value = _written_value(key, tp, *_unquoted(item, text))
    for name in reversed(names):
        value = {name: value}
    return typing.cast(dict[str, Any], value)


def _unquoted(item: str, text: str) -> tuple[str, bool]:
    """The text of an override's value and whether it was quoted (or empty: text too)."""
    if not text.startswith(("'", '"')):
        return text, text == ""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"ccld config: override {shown(item)}: the quoted value is not valid YAML "
            f"({problem(exc)}); close the quote, e.g. job='007'"
        ) from None
    if not isinstance(node, ScalarNode) or node.style not in ("'", '"'):
        raise ConfigError(
            f"ccld config: override {shown(item)}: text follows the quoted value; quote all "
            "of it, e.g. job='007'"
        )
    return node.value, True


def read_yaml(text: str, schema: type, where: str) -> dict[str, Any]:
    """The values of a YAML document, read from its nodes: a scalar's text as written, so
    that YAML 1.1 never turns ``007`` or ``12:30`` into a number. Empty: no values."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"ccld config: {where} is not valid YAML{at}: {problem(exc)}") from None
    except RecursionError:  # the composer recurses once per level
        raise ConfigError(
            f"ccld config: {where} nests too deeply; expected YAML keys like configs/default.yaml"
        ) from None
    if root is None:
        return {}
    if not isinstance(root, MappingNode):
        held = "a list" if isinstance(root, SequenceNode) else f"one value, {_node_text(root)}"
        raise ConfigError(
            f"ccld config: {where} holds {held}; expected YAML keys like configs/default.yaml"
        )
    return _read_nodes(root, schema, "", where)


def _read_nodes(node: MappingNode, schema: type, prefix: str, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        name = key_node.value if isinstance(key_node, ScalarNode) else _node_text(key_node)
        key = f"{prefix}{name}"
        tp = _hints(schema).get(name)
        try:
            if tp is None:
                raise _unknown(key, schema)
            if name in out:
                raise ConfigError(f"ccld config: {key} is given twice; keep one")
            _refuse_tag(key, value_node)
            if not _is_section(tp):
                out[name] = _node_value(key, tp, value_node)
                continue
            if not isinstance(value_node, MappingNode):
                raise _not_a_section(key, tp, _node_text(value_node))
        except ConfigError as exc:  # said with the place in the file
            line = key_node.start_mark.line + 1
            said = str(exc).removeprefix("ccld config: ")
            raise ConfigError(f"ccld config: {where}, line {line}: {said}") from None
        out[name] = _read_nodes(value_node, tp, f"{key}.", where)
    return out


def _node_value(key: str, tp: Any, node: Node) -> Any:
    if isinstance(node, ScalarNode):
        quoted = node.style is not None  # quoted, or a | or > block: text
        return _written_value(key, tp, node.value, quoted)
    base, optional = _leaf(tp)
    raise _refused(key, node.value, base, optional)


def _refuse_tag(key: str, node: Node) -> None:
    """A value tagged by hand (``!!python/object``, ``!!binary``, ``!custom``) is not
    read: the value is what is written."""
    if isinstance(node, MappingNode):
        implicit = MAP_TAG
    elif isinstance(node, ScalarNode):
        plain = node.style is None
        implicit = _IMPLICIT.resolve(ScalarNode, node.value, (plain, not plain))
    else:
        return  # a list: refused as not a value of the key's type
    if node.tag not in (implicit, STR_TAG):  # !!str: text, as it is read anyway
        raise ConfigError(
            f"ccld config: {key}: the YAML tag {shown(node.tag)} is not supported; write the "
            "value without a tag"
        )


def _node_text(node: Node) -> str:
    if isinstance(node, ScalarNode):
        return shown(node.value)
    return "<a list>" if isinstance(node, SequenceNode) else "<a mapping>"


def problem(exc: BaseException) -> str:
    """What a parser found wrong, on one line, cut."""
    said = [getattr(exc, "context", None), getattr(exc, "problem", None)]  # a YAMLError's
    text = ", ".join(str(part) for part in said if part) or str(exc)
    line = " ".join(text.split()) or type(exc).__name__
    return line if len(line) <= 2 * SHOWN_CHARS else f"{line[: 2 * SHOWN_CHARS]}...[cut]"
