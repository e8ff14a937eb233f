"""Reading values the way a YAML user writes them: `key=value` overrides, `1e-5` strings, key line numbers,
type names for messages and spelling suggestions."""

from __future__ import annotations

import difflib
import math
import re
import sys
from pathlib import Path

import yaml

from .errors import ConfigError

# PyYAML reads `1e-5` (no dot) as a string; the seed turns such strings into floats.
_SCI_NOTATION = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)$")


def apply_override(data: dict, item: str, names: set[str]) -> None:
    """Apply `key=value` (a dotted key reaches into nested mappings; the value is YAML); `names`: the top-level keys."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}); write it as in the "
                          "config file, quoted for the shell (e.g. 'key=[1, 2]')") from None
    value = coerce_scientific(value)  # `lr=1e-3`: YAML reads a string; on the command line it is plainly a number
    parts = key.split(".")
    if parts[0] not in names:
        raise ConfigError(f"override {item!r}: unknown key {parts[0]!r}{suggestion(parts[0], names)}")
    target = data
    for part in parts[:-1]:
        child = target.get(part)
        if child is None:
            child = target[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a mapping")
        target = child
    target[parts[-1]] = value


def check_unique_overrides(overrides) -> None:
    """A key given twice on the command line would silently take the last value: refused, naming both."""
    seen: dict[str, str] = {}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in seen:
            raise ConfigError(f"key {key!r} is given twice on the command line ({seen[key]!r} and {item!r}); keep one")
        seen[key] = item


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (the last would silently win)."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the base loader says what is wrong with it
                break
            if first is not None:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} is given twice (first on line "
                                  f"{first}); keep one")
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_user_text(path: Path, what: str) -> str:
    """A text file the user wrote (the config, a DeepSpeed JSON), as UTF-8 (a leading BOM dropped); one line
    naming `what` and the file when it cannot be read or is not UTF-8 (where: line and byte)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        offset = exc.start + len(raw) - len(exc.object)  # the decoder counts after a BOM it dropped
        line = raw[:offset].count(b"\n") + 1
        raise ConfigError(f"{what} {path} is not UTF-8 (line {line}, byte {offset}: {raw[offset]:#04x}); save "
                          "it as UTF-8") from None


def int_at_least(minimum: int):
    """An argparse `type` for a whole number >= `minimum` (the flag's name is added by argparse)."""
    import argparse

    def parse(text: str) -> int:
        if not text.strip().lstrip("-").isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)

    return parse


def coerce_scientific(value):
    """`"1e-5"` -> 1e-05, in nested mappings and lists too; anything else unchanged (the same object)."""
    if isinstance(value, dict):
        return {k: coerce_scientific(v) for k, v in value.items()}
    if isinstance(value, list):
        return [coerce_scientific(v) for v in value]
    if isinstance(value, str) and _SCI_NOTATION.match(value):
        return float(value)
    return value


def non_finite_at(value, where: str) -> tuple[str, float | int] | None:
    """The first number in `value` (walked through its lists and mappings) that is not finite as a float, and its
    position (`key.sub[1]`), or None. NaN passes every comparison such as `x <= 0`, so range checks would miss it."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (where, value)
    if isinstance(value, int) and not isinstance(value, bool):
        return None if abs(value) <= sys.float_info.max else (where, value)
    if isinstance(value, dict):
        items = ((f"{where}.{key}", item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{where}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    return next((found for position, item in items if (found := non_finite_at(item, position)) is not None), None)


def not_finite_message(position: str, number) -> str:
    """What is wrong with a number non_finite_at found, and what to give instead."""
    if isinstance(number, float) and math.isnan(number):
        what = "NaN (not a number)"
    elif isinstance(number, float):
        what = f"{number} (YAML's .inf, or a number beyond ±{sys.float_info.max:.1e})"
    else:
        what = f"a whole number of {len(str(abs(number)))} digits, beyond any float (±{sys.float_info.max:.1e})"
    return f"{position} is {what}, but a finite number is needed"


def reads_as_not_finite(text) -> bool:
    """A string such as `nan`, `inf` or `-Infinity`, which float() reads but is no finite number."""
    try:
        return isinstance(text, str) and not math.isfinite(float(text))
    except ValueError:
        return False


def plain(value):
    """Drop values YAML cannot write (callables set as hooks) from a nested mapping."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if not callable(v)}
    return value


def suggestion(key: str, names) -> str:
    """The nearest of `names` to `key` (letter case aside: `FSDP` finds `fsdp`), as the end of a message."""
    by_lower = {name.lower(): name for name in sorted(names)}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.5)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def allowed_types(annotation) -> tuple:
    mapping = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict, "list": list, "None": type(None)}
    return tuple(mapping[part.strip()] for part in str(annotation).split("|"))


def describe_types(types: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false", dict: "a mapping",
             list: "a list", type(None): "null"}
    return " or ".join(names[t] for t in types)


def top_level_key_lines(text: str) -> dict[str, int]:
    """The line each top-level key of a YAML text stands on (for messages)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def parse_size(text: str, key: str = "--device-memory") -> int:
    """`80GB`, `24GiB`, `512MB`, `1.5T` or a number of bytes (units are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", str(text).lower())
    size = int(float(match.group(1)) * 1024 ** "bkmgt".index(match.group(2) or "b")) if match else 0
    if size <= 0:
        raise ConfigError(f"{key} {text!r}: give a size such as 80GB, 24GiB or 512MB")
    return size
