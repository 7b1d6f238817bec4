"""What the simulated model writes when its output is not free text. Pure and deterministic
under a seed.

- Constrained decoding (SGLang's `json_schema` sampling parameter): a value generated from the
  schema, valid against it, written as compact JSON.
- Tool use: a prompt that offers tools (their JSON definitions, as chat templates render them)
  and whose conversation after them mentions tools' names (their words, e.g. "weather" for
  `get_weather`) gets a call of each such tool in the model family's format
  (`--tool-call-parser`), with arguments generated from the tool's parameter schema. Once the conversation holds a call
  of it (the tool ran), the model answers in text again.
"""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

FAMILIES = ("llama3", "hermes", "qwen25", "qwen")
_WORDS = ("alpha", "bravo", "delta", "echo", "harbor", "lima", "nova", "paris", "oslo", "tango")
_decoder = json.JSONDecoder()


class SchemaError(ValueError):
    """The schema cannot be compiled (SGLang's grammar backend refuses it)."""


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """The schema a (chain of) local `$ref` names; SchemaError for a reference that names nothing
    or a chain that comes back to itself (it would never name a schema)."""
    seen: list[str] = []
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"unsupported $ref {ref!r}")
        if ref in seen:
            raise SchemaError(f"$ref cycle: {' -> '.join([*seen, ref])}")
        seen.append(ref)
        target: Any = root
        for raw in ref[2:].split("/") if ref != "#" else ():
            part = raw.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"unresolvable $ref {ref!r}")
            target = target[part]
        schema = target
    return schema


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    if fmt == "date":
        return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if fmt == "date-time":
        return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:00:00Z"
    if fmt == "email":
        return f"{rng.choice(_WORDS)}@example.com"
    if "pattern" in schema:
        raise SchemaError("string patterns are not supported by the simulated engine")
    low = int(schema.get("minLength", 1))
    high = int(schema.get("maxLength", max(low, 12)))
    if low > high:
        raise SchemaError(f"minLength {low} > maxLength {high}")
    text = rng.choice(_WORDS)
    while len(text) < low:
        text += " " + rng.choice(_WORDS)
    return text[:high] if len(text) > high else text


def _number(schema: dict[str, Any], rng: random.Random, integer: bool) -> int | float:
    low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
    high = schema.get("maximum", schema.get("exclusiveMaximum", max(low, 0) + 100))
    if "exclusiveMinimum" in schema:
        low = low + 1 if integer else low + (high - low) / 1000
    if "exclusiveMaximum" in schema:
        high = high - 1 if integer else high - (high - low) / 1000
    if low > high:
        raise SchemaError("empty numeric range")
    if integer:
        return rng.randint(math.ceil(low), math.floor(high))
    return round(rng.uniform(low, high), 3)


def value_from_schema(schema: Any, rng: random.Random, root: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A value valid against `schema` (the JSON Schema subset constrained decoders support)."""
    root = root if root is not None else (schema if isinstance(schema, dict) else {})
    if depth > 16:
        raise SchemaError("schema nests too deeply")
    if schema is True or schema == {}:
        return {}
    if not isinstance(schema, dict):
        raise SchemaError("a schema must be an object")
    schema = _resolve(schema, root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        if not schema["enum"]:
            raise SchemaError("empty enum")
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return value_from_schema(rng.choice(schema[key]), rng, root, depth + 1)
    if "allOf" in schema:
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged.update(_resolve(part, root))
        return value_from_schema(merged, rng, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        properties = schema.get("properties", {})
        required = schema.get("required", list(properties))
        value = {}
        for name in properties:
            if name in required or rng.random() < 0.5:
                value[name] = value_from_schema(properties[name], rng, root, depth + 1)
        missing = [name for name in required if name not in properties]
        for name in missing:
            value[name] = value_from_schema(schema.get("additionalProperties") or {"type": "string"}, rng, root, depth + 1)
        return value
    if kind == "array":
        low = int(schema.get("minItems", 1))
        high = int(schema.get("maxItems", max(low, 3)))
        if low > high:
            raise SchemaError(f"minItems {low} > maxItems {high}")
        items = schema.get("items", {"type": "string"})
        if isinstance(items, list):
            raise SchemaError("tuple-form items are not supported")
        return [value_from_schema(items, rng, root, depth + 1) for _ in range(rng.randint(low, min(high, low + 2)))]
    if kind == "string":
        return _string(schema, rng)
    if kind in ("integer", "number"):
        return _number(schema, rng, kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    raise SchemaError(f"unknown type {kind!r}")


def json_output(schema_text: str, rng: random.Random) -> str:
    """The output under SGLang's `json_schema` constraint; SchemaError if it cannot compile."""
    try:
        schema = json.loads(schema_text)
    except ValueError as error:
        raise SchemaError(f"json_schema is not JSON: {error}") from None
    try:
        value = value_from_schema(schema, rng)
    except RecursionError:  # a schema this generator cannot bound: refused, as a grammar backend would
        raise SchemaError("the schema nests too deeply to compile") from None
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


# ---- tool use ----------------------------------------------------------------------------------


def offered_tools(prompt: str) -> tuple[list[dict[str, Any]], int]:
    """Tool definitions rendered into `prompt` (OpenAI's `{"type": "function", "function": {...}}`
    or bare `{"name", "parameters"}` objects), and where the last one ends."""
    tools: list[dict[str, Any]] = []
    end = 0
    if '"parameters"' not in prompt:
        return tools, end
    position = prompt.find("{")
    while position >= 0:
        try:
            obj, stop = _decoder.raw_decode(prompt, position)
        except ValueError:
            position = prompt.find("{", position + 1)
            continue
        candidates = obj if isinstance(obj, list) else [obj]
        found = False
        for candidate in candidates:
            if isinstance(candidate, dict) and isinstance(candidate.get("function"), dict):
                candidate = candidate["function"]
            if isinstance(candidate, dict) and isinstance(candidate.get("name"), str) and "parameters" in candidate:
                tools.append(candidate)
                found = True
        if found:
            end = stop
            position = prompt.find("{", stop)
        else:
            position = prompt.find("{", position + 1)
    return tools, end


def _name_words(name: str) -> list[str]:
    words = re.split(r"[_\-\s]+|(?<=[a-z])(?=[A-Z])", name)
    return [w.lower() for w in words if len(w) > 3] or [name.lower()]


def tool_call_output(prompt: str, family: str, rng: random.Random) -> str | None:
    """The call the simulated model makes for `prompt`, in `family`'s format, or None (text)."""
    tools, end = offered_tools(prompt)
    if not tools:
        return None
    conversation = prompt[end:]
    lowered = conversation.lower()
    for tool in tools:
        if f'"{tool["name"]}"' in conversation:
            return None  # called already: the result is in the conversation, answer it
    asked = [tool for tool in tools if all(word in lowered for word in _name_words(tool["name"]))]
    if not asked:
        return None
    calls = [(tool["name"], value_from_schema(tool.get("parameters") or {"type": "object"}, rng)) for tool in asked]
    if family == "llama3":
        return "; ".join(json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
                         for name, arguments in calls)
    return "\n".join(f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"
                     for name, arguments in calls)
