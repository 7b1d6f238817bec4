"""JSON Schemas that clients send (response formats, tool parameters), checked at the edge."""

from __future__ import annotations

import urllib.parse
from typing import Any

import jsonschema

from inferbus.openai.errors import OpenAIError

# Keywords whose values are data, not schemas: a `$ref` key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def check_json_schema(schema: dict[str, Any], param: str) -> None:
    """400 naming `param` and where the schema is wrong, if it is not valid JSON Schema, or if a
    constrained decoder could not compile it: a `$ref` outside the document, one that names
    nothing, or references that lead back to themselves without a value in between
    (`{"$ref": "#/$defs/a"}` where `a` is `{"$ref": "#/$defs/a"}`)."""
    check = jsonschema.validators.validator_for(schema).check_schema
    try:
        check(schema)
    except jsonschema.SchemaError as invalid:
        where = "/".join(str(p) for p in invalid.path)
        raise OpenAIError(400, f"Invalid schema for {param}" + (f" at `{where}`" if where else "")
                          + f": {invalid.message}", param=param, code="invalid_value") from None
    problem = ref_problem(schema)
    if problem is not None:
        raise OpenAIError(400, f"Invalid schema for {param}: {problem}", param=param, code="invalid_value")


def ref_problem(schema: Any) -> str | None:
    """Why the schema's references cannot be compiled, or None if they can."""
    resolved: set[str] = set()  # references already followed to a schema: each chain is walked once
    for ref in _refs(schema):
        seen = [ref]
        following = ref
        while following not in resolved:
            target = _target(schema, following)
            if target is None:
                return f"`$ref` {following!r} does not name a part of this schema (only local references, `#/...`)"
            if not (isinstance(target, dict) and isinstance(target.get("$ref"), str)):
                break
            following = target["$ref"]
            if following in seen:
                return f"`$ref` {ref!r} is a reference cycle ({' -> '.join([*seen, following])})"
            seen.append(following)
        resolved.update(seen)
    return None


def _refs(node: Any) -> list[str]:
    """Every `$ref` string in the schema, iteratively (a deep schema is not a deep Python stack)."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if isinstance(current.get("$ref"), str):
                found.append(current["$ref"])
            stack.extend(value for key, value in current.items() if key not in _DATA_KEYWORDS)
        elif isinstance(current, list):
            stack.extend(current)
    return found


def _target(root: Any, ref: str) -> Any:
    """What the local reference `ref` (`#` or `#/a/b`, JSON Pointer escapes) names; None if nothing."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    target = root
    for raw in ref[2:].split("/"):
        part = urllib.parse.unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target
