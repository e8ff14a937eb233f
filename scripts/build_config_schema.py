"""Writes docs/config.schema.json: a JSON Schema (draft 2020-12) of the YAML config, for editors (completion, types,
the allowed names of a choice, each key's description on hover) and for checking a config before a run.

    .venv/bin/python scripts/build_config_schema.py           # rewrite it
    .venv/bin/python scripts/build_config_schema.py --check   # exit 1 where it differs from what the code gives

The keys, their types and defaults come from `PreTrainingArguments`, the allowed names from its `CHOICES`, the
numbers' ranges from its `BOUNDS`, the descriptions from the key tables of docs/configuration.md. The loader stays the
authority: it also checks paths and the rules between keys (config/features.py, run/rules.py), which a schema cannot
say.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "config.schema.json"
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array",
              type(None): "null"}
# PyYAML reads `1e-5` as a string; the loader takes it as the number it spells
SCIENTIFIC = r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$"
ROW = re.compile(r"^\| (`[a-z_0-9]+`(?:(?:, | / )`[a-z_0-9]+`)*) \| [^|]* \| (.+) \|\s*$")  # one key or several


def descriptions() -> dict[str, str]:
    """Each key's description, from docs/configuration.md's tables (`| `key` | default | what it does |`)."""
    found = {}
    for line in (REPO / "docs" / "configuration.md").read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        for key in re.findall(r"`([a-z_0-9]+)`", match.group(1)) if match else ():
            text = re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", match.group(2))  # a link's text, not its target
            found.setdefault(key, text.replace("`", "").strip())
    return found


def key_schema(field, described: dict[str, str]) -> dict:
    from pretrainer.config.arguments import BOUNDS, CHOICES, bound_limits
    from pretrainer.config.loading import allowed_types

    types = allowed_types(field.type)
    schema: dict = {"type": [JSON_TYPES[t] for t in types] if len(types) > 1 else JSON_TYPES[types[0]]}
    if field.name in CHOICES:
        # a YAML `off` reads as false: such keys take true/false for on/off
        schema["enum"] = [*CHOICES[field.name], *([None] if type(None) in types else []),
                          *([True, False] if bool in types else [])]
    if field.name in BOUNDS:  # numeric keywords hold for numbers only (a null passes them)
        low, low_allowed, high, high_allowed = bound_limits(BOUNDS[field.name][0])
        schema["minimum" if low_allowed else "exclusiveMinimum"] = int(low) if low.is_integer() else low
        if high is not None:
            schema["maximum" if high_allowed else "exclusiveMaximum"] = int(high) if high.is_integer() else high
    if float in types:
        schema = {"anyOf": [schema, {"type": "string", "pattern": SCIENTIFIC}]}
    if field.default is not dataclasses.MISSING:
        schema["default"] = field.default
    if field.name in described:
        schema["description"] = described[field.name]
    return schema


def config_schema() -> dict:
    from pretrainer import PreTrainingArguments

    fields = dataclasses.fields(PreTrainingArguments)
    described = descriptions()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "pretrainer config",
            "description": "A pretrainer YAML config (pretrainer train CONFIG.yaml). See docs/configuration.md.",
            "type": "object", "additionalProperties": False,
            "required": [f.name for f in fields if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING],
            "properties": {f.name: key_schema(f, described) for f in fields}}


def main(argv: list[str]) -> int:
    text = json.dumps(config_schema(), indent=1, ensure_ascii=False) + "\n"
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(REPO)} is out of date: run .venv/bin/python scripts/build_config_schema.py")
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(REPO)} ({len(config_schema()['properties'])} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
