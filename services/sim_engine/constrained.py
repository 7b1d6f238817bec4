"""What the simulated model writes when its output is not free text. Pure and deterministic
under a seed.

- Constrained decoding (SGLang's `json_schema` sampling parameter): a value generated from the
  schema, valid against it, on one line with `, ` and `: ` between tokens and no other whitespace,
  as SGLang (XGrammar) writes it with `--constrained-json-disable-any-whitespace`, which every
  platform engine runs with.
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

FAMILIES = ("llama3", "hermes", "qwen25", "qwen", "mistral", "pythonic", "deepseekv3", "deepseekv31", "gpt-oss")
_WORDS = ("alpha", "bravo", "delta", "echo", "harbor", "lima", "nova", "paris", "oslo", "tango")
_decoder = json.JSONDecoder()


class SchemaError(ValueError):
    """The schema cannot be compiled (SGLang's grammar backend refuses it)."""


# Generation keeps to required properties, minimal arrays and the non-recursive branches of a
# choice from this depth on, so recursive schemas (a tree of `$ref`s) end; a schema that still
# needs more levels than the limit has no value a decoder could finish.
_SHALLOW_DEPTH = 6
_MAX_DEPTH = 48


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    seen: set[str] = set()
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"unsupported $ref {ref!r}")
        if ref in seen:
            raise SchemaError(f"$ref {ref!r} refers to itself")
        seen.add(ref)
        target: Any = root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"unresolvable $ref {ref!r}")
            target = target[part]
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **siblings} if siblings and isinstance(target, dict) else target
    return schema


def _recursive(schema: Any) -> bool:
    """Whether a schema refers on (`$ref` anywhere in it): the branch a shallow value avoids."""
    return "$ref" in json.dumps(schema) if isinstance(schema, (dict, list)) else False


# ---- strings matching a `pattern` (the regular expressions JSON Schema grammars compile) ------

_CATEGORIES = {
    "CATEGORY_DIGIT": "0123456789",
    "CATEGORY_WORD": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_",
    "CATEGORY_SPACE": " ",
    "CATEGORY_NOT_DIGIT": "abcxyz",
    "CATEGORY_NOT_WORD": " -.",
    "CATEGORY_NOT_SPACE": "abc123",
}
_PRINTABLE = [chr(c) for c in range(0x20, 0x7F)]


def _class_chars(items: list[Any]) -> list[str]:
    negate = bool(items) and str(items[0][0]) == "NEGATE"
    chars: list[str] = []
    for op, value in items[1:] if negate else items:
        name = str(op)
        if name == "LITERAL":
            chars.append(chr(value))
        elif name == "RANGE":
            low, high = value
            chars.extend(chr(c) for c in range(low, min(high, low + 200) + 1))
        elif name == "CATEGORY":
            chars.extend(_CATEGORIES.get(str(value), ""))
        else:
            raise SchemaError(f"unsupported character class item {name}")
    if negate:
        return [c for c in _PRINTABLE if c not in set(chars)]
    return chars


def _from_pattern(parsed: Any, rng: random.Random) -> str:
    out: list[str] = []
    for op, value in parsed:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(value))
        elif name == "NOT_LITERAL":
            out.append(rng.choice([c for c in "abcxyz019" if ord(c) != value]))
        elif name == "ANY":
            out.append(rng.choice("abcdefxyz0123"))
        elif name == "IN":
            choices = _class_chars(value)
            if not choices:
                raise SchemaError("pattern has an empty character class")
            out.append(rng.choice(choices))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, item = value
            high = min(high, low + 3)  # unbounded repeats: a few
            out.extend(_from_pattern(item, rng) for _ in range(rng.randint(low, max(low, high))))
        elif name == "SUBPATTERN":
            out.append(_from_pattern(value[-1], rng))
        elif name == "BRANCH":
            out.append(_from_pattern(rng.choice(value[1]), rng))
        elif name == "AT":
            continue  # ^ and $: JSON Schema patterns are searched, the value is the whole match
        elif name == "CATEGORY":
            out.append(rng.choice(_CATEGORIES.get(str(value), "a")))
        else:
            raise SchemaError(f"pattern construct {name} is not supported (no lookaround or backreferences)")
    return "".join(out)


def string_matching(pattern: str, rng: random.Random) -> str:
    """A string `pattern` finds (JSON Schema's `pattern` semantics); SchemaError if it cannot be made."""
    try:
        compiled = re.compile(pattern)
        parsed = re._parser.parse(pattern)  # type: ignore[attr-defined]
    except (re.error, RecursionError) as error:
        raise SchemaError(f"invalid pattern {pattern!r}: {error}") from None
    text = _from_pattern(parsed, rng)
    if compiled.search(text) is None:
        raise SchemaError(f"pattern {pattern!r} is not supported")
    return text


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    if fmt == "date":
        return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if fmt == "date-time":
        return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:00:00Z"
    if fmt == "email":
        return f"{rng.choice(_WORDS)}@example.com"
    low = int(schema.get("minLength", 1 if "pattern" not in schema else 0))
    high = int(schema.get("maxLength", max(low, 12)))
    if low > high:
        raise SchemaError(f"minLength {low} > maxLength {high}")
    if "pattern" in schema:
        for _ in range(20):
            text = string_matching(schema["pattern"], rng)
            if low <= len(text) <= high:
                return text
        raise SchemaError(f"no string of {low}-{high} characters matching {schema['pattern']!r} was found")
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
    """A value valid against `schema` (the JSON Schema subset constrained decoders support,
    recursive `$ref`s included: deeper levels take the shortest way out)."""
    root = root if root is not None else (schema if isinstance(schema, dict) else {})
    if depth > _MAX_DEPTH:
        raise SchemaError(f"the schema has no value within {_MAX_DEPTH} levels of nesting")
    if schema is True or schema == {}:
        return {}
    if not isinstance(schema, dict):
        raise SchemaError("a schema must be an object")
    schema = _resolve(schema, root)
    shallow = depth >= _SHALLOW_DEPTH
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        if not schema["enum"]:
            raise SchemaError("empty enum")
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            branches = schema[key]
            if not branches:
                raise SchemaError(f"empty {key}")
            if shallow:
                branches = [b for b in branches if not _recursive(b)] or branches
            return value_from_schema(rng.choice(branches), rng, root, depth + 1)
    if "allOf" in schema:
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged.update(_resolve(part, root))
        return value_from_schema(merged, rng, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        if shallow and "null" in kind:
            return None
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = (
            "object"
            if "properties" in schema
            else "array"
            if "items" in schema or "prefixItems" in schema
            else "string"
        )
    if kind == "object":
        properties = schema.get("properties", {})
        required = schema.get("required", list(properties) if not shallow else [])
        value = {}
        for name in properties:
            if name in required or (not shallow and rng.random() < 0.5):
                value[name] = value_from_schema(properties[name], rng, root, depth + 1)
        missing = [name for name in required if name not in properties]
        for name in missing:
            value[name] = value_from_schema(
                schema.get("additionalProperties") or {"type": "string"}, rng, root, depth + 1
            )
        return value
    if kind == "array":
        prefix = schema.get("prefixItems")
        items = schema.get("items", {"type": "string"} if prefix is None else False)
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems", False)
        prefix = prefix or []
        low = int(schema.get("minItems", len(prefix) or (0 if shallow else 1)))
        high = int(schema.get("maxItems", max(low, len(prefix), 3)))
        if items is False:
            high = min(high, len(prefix))
        if low > high:
            raise SchemaError(f"minItems {low} > maxItems {high}")
        count = low if shallow else rng.randint(low, min(high, low + 2))
        count = max(count, min(len(prefix), high))
        if count > len(prefix) and items is False:
            raise SchemaError("minItems needs more items than prefixItems allows")
        return [value_from_schema(prefix[i] if i < len(prefix) else items, rng, root, depth + 1) for i in range(count)]
    if kind == "string":
        return _string(schema, rng)
    if kind in ("integer", "number"):
        return _number(schema, rng, kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    raise SchemaError(f"unknown type {kind!r}")


def json_output(schema_text: str, rng: random.Random, prompt: str = "") -> str:
    """The output under SGLang's `json_schema` constraint; SchemaError if it cannot compile.

    As a model would: an open object schema (`json_object`) is filled from a JSON Schema written
    in the prompt (instructor, LangChain and others put it there), else it is an object with an
    answer in it; a forced call of one of several tools calls the ones the conversation asks for."""
    try:
        schema = json.loads(schema_text)
    except ValueError as error:
        raise SchemaError(f"json_schema is not JSON: {error}") from None
    either = _either(schema)
    if either is not None:
        # Calls or the final answer (tools under `auto` with a JSON response format): the tools the
        # conversation asks for until they have run, then the answer.
        calls_schema, answer = either
        calls = _asked_calls(calls_schema, prompt, rng, skip_called=True)
        if calls is not None:
            return _dump(calls)
        schema = answer
    return _dump(_answer(schema, rng, prompt))


def _either(schema: Any) -> tuple[dict[str, Any], Any] | None:
    """(calls schema, answer schema) of the gateway's either-or constraint
    (`{"anyOf": [<calls of the tools>, <answer>]}`), else None."""
    branches = schema.get("anyOf") if isinstance(schema, dict) and set(schema) == {"anyOf"} else None
    if not isinstance(branches, list) or len(branches) != 2 or _call_branches(branches[0]) is None:
        return None
    return branches[0], branches[1]


def _answer(schema: Any, rng: random.Random, prompt: str) -> Any:
    if _open_object(schema):
        written = schema_in_prompt(prompt)
        if written is not None:
            try:
                return value_from_schema(written, rng)
            except SchemaError:
                pass  # not one the model can follow: answer as without it
        return {"answer": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))}
    calls = _asked_calls(schema, prompt, rng)
    if calls is not None:
        return calls
    return value_from_schema(schema, rng)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))  # XGrammar's without any_whitespace


def _open_object(schema: Any) -> bool:
    """`{"type": "object"}` and nothing that says what goes in it: what `json_object` asks for."""
    return isinstance(schema, dict) and schema.get("type") == "object" and not (
        set(schema) - {"type", "additionalProperties", "title", "description"})


def schema_in_prompt(prompt: str) -> dict[str, Any] | None:
    """The last JSON Schema of an object written in the prompt (one with `properties`), not a
    tool definition's parameters."""
    _, end = offered_tools(prompt)
    text = prompt[end:]
    found: dict[str, Any] | None = None
    position = text.find("{")
    while position >= 0:
        try:
            obj, stop = _decoder.raw_decode(text, position)
        except ValueError:
            position = text.find("{", position + 1)
            continue
        if isinstance(obj, dict) and isinstance(obj.get("properties"), dict) and obj["properties"]:
            found = obj
            position = text.find("{", stop)
        else:
            position = text.find("{", position + 1)
    return found


def _call_branches(schema: Any) -> dict[str, dict[str, Any]] | None:
    """Tool name → its item schema, when `schema` is an array of `{"name": const, "parameters"}`
    items of several tools (the gateway's schema of a call of any of them); else None."""
    if not isinstance(schema, dict) or schema.get("type") != "array":
        return None
    items: Any = schema.get("items")
    branches: Any = items.get("anyOf") if isinstance(items, dict) and "anyOf" in items else [items]
    if not isinstance(branches, list):
        return None
    by_name: dict[str, dict[str, Any]] = {}
    for branch in branches:
        properties = branch.get("properties") if isinstance(branch, dict) else None
        if not isinstance(properties, dict) or "parameters" not in properties:
            return None
        name = properties.get("name", {}).get("const") if isinstance(properties.get("name"), dict) else None
        if not isinstance(name, str):
            return None
        by_name[name] = branch
    return by_name


def _asked_calls(
    schema: Any, prompt: str, rng: random.Random, skip_called: bool = False
) -> list[dict[str, Any]] | None:
    """Under a forced call of any of several tools (as the gateway sends for `tool_choice:
    required`), the calls of the tools the conversation asks for (`skip_called`: and that have
    not run yet); None when it asks for none of them."""
    by_name = _call_branches(schema)
    if by_name is None:
        return None
    conversation = prompt_conversation(prompt)
    asked = [name for name in by_name if _asks_for(conversation, name)
             and not (skip_called and f'"{name}"' in conversation)]
    if not asked:
        return None
    asked = asked[:int(schema.get("maxItems", len(asked)))]
    return [value_from_schema(by_name[name], rng, schema) for name in asked]


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


def prompt_conversation(prompt: str) -> str:
    """The prompt after the tool definitions rendered into it (all of it when there are none)."""
    return prompt[offered_tools(prompt)[1]:]


def _asks_for(conversation: str, name: str) -> bool:
    """Whether the conversation names a tool (all the words of its name: "weather" for `get_weather`)."""
    lowered = conversation.lower()
    return all(word in lowered for word in _name_words(name))


def tool_call_output(prompt: str, family: str, rng: random.Random) -> str | None:
    """The call the simulated model makes for `prompt`, in `family`'s format, or None (text)."""
    tools, end = offered_tools(prompt)
    if not tools:
        return None
    conversation = prompt[end:]
    for tool in tools:
        if f'"{tool["name"]}"' in conversation:
            return None  # called already: the result is in the conversation, answer it
    asked = [tool for tool in tools if _asks_for(conversation, tool["name"])]
    if not asked:
        return None
    calls = [(tool["name"], value_from_schema(tool.get("parameters") or {"type": "object"}, rng)) for tool in asked]
    if family == "llama3":
        return "; ".join(json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
                         for name, arguments in calls)
    if family == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls],
                                           ensure_ascii=False)
    if family in ("deepseekv3", "deepseekv31"):
        def one(name: str, arguments: Any) -> str:
            if family == "deepseekv3":
                return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
                        f"{json.dumps(arguments, ensure_ascii=False)}\n```<｜tool▁call▁end｜>")
            return (f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>"
                    f"{json.dumps(arguments, ensure_ascii=False)}<｜tool▁call▁end｜>")

        return (
            "<｜tool▁calls▁begin｜>"
            + "\n".join(one(name, arguments) for name, arguments in calls)
            + "<｜tool▁calls▁end｜>"
        )
    if family == "gpt-oss":
        # Harmony: a thought in the analysis channel, then one commentary message to each function.
        return f"<|channel|>analysis<|message|>I should call {', '.join(name for name, _ in calls)}.<|end|>" + "".join(
            f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{json.dumps(arguments, ensure_ascii=False)}<|call|>" for name, arguments in calls)
    if family == "pythonic":
        return "[" + ", ".join(f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"
                               for name, arguments in calls) + "]"
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"
        for name, arguments in calls
    )
