"""Tool calls: checking `tools`/`tool_choice`, constraining the engine when a call is forced, and
reading the model's output back into OpenAI `tool_calls`. Pure: no I/O.

Models write tool calls in their family's own format, so one parser per family reads them, chosen
by configuration (`INFERBUS_TOOL_CALL_PARSER`, named as SGLang's `--tool-call-parser`):

- `llama3`: Llama 3.1+ JSON, `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
  several separated by `;`. Only an output that starts with a call is one.
- `hermes` (also `qwen25`, `qwen`): Hermes/Qwen blocks, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  anywhere in the output; text outside the blocks is content.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`;
  call ids are 9 letters and digits, the only ids Mistral's templates take back.
- `pythonic` (Llama-4): `[get_weather(city="Paris"), ...]`, optionally in `<|python_start|>...<|python_end|>`.
- `deepseekv3`, `deepseekv31`: a `<｜tool▁calls▁begin｜>` block of calls after any content.
- `gpt-oss`: OpenAI's harmony messages; a call is a message to `functions.NAME` with JSON arguments,
  `<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>`.
  The `final` channel (and commentary to no one) is content; the `analysis` channel is reasoning
  and left out. Its markers are special tokens, so the engine is asked to keep them in its text
  (`KEEPS_SPECIAL_TOKENS`).

A call that does not parse, or names a tool that was not offered, comes back as content. When
`tool_choice` forces a call (`required` or a named function) the engine is constrained by a JSON
schema instead (SGLang's `json_schema` sampling parameter), so the output is always a valid call
in a family-independent shape: the arguments object (named) or a list of `{"name", "parameters"}`
(required). With `auto` and a JSON `response_format` the model chooses between the two, as
OpenAI lets it: the schema is either that list of calls or the answer's value (`either_constraint`).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from inferbus.openai.errors import OpenAIError
from inferbus.openai.jsonschemas import check_json_schema

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=lambda: call_id("openai"))

    def body(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call = {"index": index, **call}
        return call


# ---- the request side ------------------------------------------------------------------------


def _invalid(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def check(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> None:
    """400 for malformed `tools` or a `tool_choice` that does not fit them."""
    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise _invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.", f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _invalid(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ or -.", f"tools[{i}].function.name"
            )
        if name in names:
            raise _invalid(f"tools[{i}].function.name `{name}` is not unique.", f"tools[{i}].function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise _invalid(
                    f"tools[{i}].function.parameters must be a JSON Schema object.", f"tools[{i}].function.parameters"
                )
            check_json_schema(parameters, f"tools[{i}].function.parameters")
    if tool_choice is None or tool_choice == "none" or tool_choice == "auto":
        return
    if tool_choice == "required":
        if not names:
            raise _invalid("tool_choice `required` needs at least one tool in `tools`.", "tool_choice")
        return
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise _invalid(
                'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}.',
                "tool_choice",
            )
        if name not in names:
            raise _invalid(f"tool_choice names `{name}`, which is not in `tools`.", "tool_choice")
        return
    raise _invalid(
        'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}.', "tool_choice"
    )


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def forced_name(tool_choice: str | dict[str, Any] | None) -> str | None:
    if isinstance(tool_choice, dict):
        return str(tool_choice["function"]["name"])
    return None


def constraint(tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any] | None,
               parallel: bool) -> dict[str, Any] | None:
    """The JSON schema the engine must follow for a forced call; None when the model may choose."""
    name = forced_name(tool_choice)
    if name is not None:
        return next(_parameters(t) for t in tools if t["function"]["name"] == name)
    if tool_choice != "required":
        return None
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def either_constraint(tools: Sequence[dict[str, Any]], parallel: bool, answer: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of an output that is either calls of offered tools (as under `required`) or
    the final answer's value (`answer`, the response format's schema): tools under `auto` with a
    JSON `response_format`."""
    calls = constraint(tools, "required", parallel)
    assert calls is not None
    return {"anyOf": [calls, answer]}


# ---- the output side -------------------------------------------------------------------------


class Parser(Protocol):
    """Reads one model family's tool calls out of its output, whole or as it streams."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished output; malformed calls stay in the content."""
        ...

    def stream(self) -> "Stream":
        ...


class Stream(Protocol):
    def feed(self, delta: str) -> list[str | ToolCall]:
        """Content that is certainly not part of a call, and calls completed by `delta`, in order."""
        ...

    def finish(self) -> list[str | ToolCall]:
        ...


def _parsed_by_stream(stream: "Stream", text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished output, read as a stream reads it (one path for both)."""
    parts = [*stream.feed(text), *stream.finish()]
    calls = [p for p in parts if isinstance(p, ToolCall)]
    content = "".join(p for p in parts if isinstance(p, str))
    return (content.strip() if calls else content), calls


def _object_call(obj: Any, names: frozenset[str], arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments" if arguments_key != "arguments" else "parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))


class Llama3Parser:
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        calls: list[ToolCall] = []
        position = 0
        while position < len(body):
            try:
                obj, end = _decoder.raw_decode(body, position)
            except ValueError:
                return text, []
            call = _object_call(obj, self.names, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and (body[position].isspace() or body[position] == ";"):
                position += 1
        return "", calls

    def stream(self) -> "_Llama3Stream":
        return _Llama3Stream(self)


class _Llama3Stream:
    """A Llama-3 call is the whole output: decide from its first characters, then either pass
    content through or hold everything until the end."""

    def __init__(self, parser: Llama3Parser) -> None:
        self.parser = parser
        self.buffer = ""
        self.mode: str | None = None  # None: undecided, "content" or "call"

    def feed(self, delta: str) -> list[str | ToolCall]:
        if self.mode == "content":
            return [delta]
        self.buffer += delta
        head = self.buffer.lstrip()
        if self.mode is None and head:
            tag = Llama3Parser.PYTHON_TAG
            if head.startswith("{") or head.startswith(tag):
                self.mode = "call"
            elif not tag.startswith(head):
                self.mode = "content"
                out, self.buffer = self.buffer, ""
                return [out]
        return []

    def finish(self) -> list[str | ToolCall]:
        if not self.buffer:
            return []
        content, calls = self.parser.parse(self.buffer)
        self.buffer = ""
        return [*([content] if content else []), *calls]


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def block(self, inner: str) -> ToolCall | None:
        try:
            obj = json.loads(inner)
        except ValueError:
            return None
        return _object_call(obj, self.names, "arguments")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return _parsed_by_stream(self.stream(), text)

    def stream(self) -> "_HermesStream":
        return _HermesStream(self)


class _HermesStream:
    def __init__(self, parser: HermesParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.inside = False

    def feed(self, delta: str) -> list[str | ToolCall]:
        self.buffer += delta
        out: list[str | ToolCall] = []
        start, end = HermesParser.START, HermesParser.END
        while True:
            if not self.inside:
                at = self.buffer.find(start)
                if at < 0:
                    # Hold back a tail that may be the beginning of `<tool_call>`.
                    keep = next((k for k in range(min(len(start) - 1, len(self.buffer)), 0, -1)
                                 if start.startswith(self.buffer[-k:])), 0)
                    text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if text:
                        out.append(text)
                    return out
                if at:
                    out.append(self.buffer[:at])
                self.buffer = self.buffer[at:]
                self.inside = True
            at = self.buffer.find(end)
            if at < 0:
                return out
            raw = self.buffer[:at + len(end)]
            self.buffer = self.buffer[at + len(end):]
            self.inside = False
            call = self.parser.block(raw[len(start):-len(end)].strip())
            out.append(call if call is not None else raw)

    def finish(self) -> list[str | ToolCall]:
        rest, self.buffer = self.buffer, ""
        if self.inside:
            # The model stopped without closing the block (an EOS right after the JSON).
            call = self.parser.block(rest[len(HermesParser.START):].strip())
            if call is not None:
                return [call]
        return [rest] if rest else []


class _WholeOutputStream:
    """A family whose call is the whole output: decided from its first characters (one of
    `starts` begins a call), then content passes through or everything is held until the end."""

    def __init__(self, parser: Parser, starts: tuple[str, ...]) -> None:
        self.parser = parser
        self.starts = starts
        self.buffer = ""
        self.mode: str | None = None  # None: undecided, "content" or "call"

    def feed(self, delta: str) -> list[str | ToolCall]:
        if self.mode == "content":
            return [delta]
        self.buffer += delta
        head = self.buffer.lstrip()
        if self.mode is None and head:
            if any(head.startswith(start) for start in self.starts):
                self.mode = "call"
            elif not any(start.startswith(head) for start in self.starts):
                self.mode = "content"
                out, self.buffer = self.buffer, ""
                return [out]
        return []

    def finish(self) -> list[str | ToolCall]:
        if not self.buffer:
            return []
        content, calls = self.parser.parse(self.buffer)
        self.buffer = ""
        return [*([content] if content else []), *calls]


class MistralParser:
    """Mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (v0.3 to Small 3.1), or
    `[TOOL_CALLS]name[ARGS]{...}` per call (Small 3.2, Magistral, Devstral). SGLang drops the
    `[TOOL_CALLS]` special token from the text by default, so an output that is such an array
    without it is read the same way."""

    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.MARKER) and self.ARGS in body:
            return self._compact(text, body)
        body = body.removeprefix(self.MARKER).lstrip()
        if not body.startswith("["):
            return text, []
        try:
            value, end = _decoder.raw_decode(body)
        except ValueError:
            return text, []
        if body[end:].strip() or not isinstance(value, list) or not value:
            return text, []
        calls = [_object_call(item, self.names, "arguments") for item in value]
        if any(call is None for call in calls):
            return text, []
        return "", [call for call in calls if call is not None]

    def _compact(self, text: str, body: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for part in body.split(self.MARKER)[1:]:
            name, _, arguments = part.partition(self.ARGS)
            call = _object_call({"name": name.strip(), "arguments": arguments.strip()}, self.names, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return "", calls

    def stream(self) -> _WholeOutputStream:
        return _WholeOutputStream(self, (self.MARKER, "["))


class PythonicParser:
    """Llama-4 and other pythonic callers: a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), get_time(zone="UTC")]`, optionally between `<|python_start|>` and
    `<|python_end|>`. Only an output that is such a list is one."""

    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                    or node.func.id not in self.names:
                return text, []
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return text, []
            calls.append(ToolCall(name=node.func.id, arguments=json.dumps(arguments, ensure_ascii=False)))
        return "", calls

    def stream(self) -> _WholeOutputStream:
        return _WholeOutputStream(self, (self.START, "["))


class DeepSeekParser:
    """DeepSeek V3 and V3.1: content, then a block of calls that ends the output.
    V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`
    `...<｜tool▁calls▁end｜>`;
    V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` inside the same block."""

    START, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>(?P<v3>[^\n<]+)\n```(?:json)?\n"
                       r"(?P<v3args>.*?)\n```"
                       r"|(?P<v31>[^<]+?)<｜tool▁sep｜>(?P<v31args>.*?))<｜tool▁call▁end｜>", re.DOTALL)

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.START)
        if at < 0:
            return text, []
        block = text[at + len(self.START):]
        block = block[:block.find(self.END)] if self.END in block else block
        calls = []
        position = 0
        for match in self._CALL.finditer(block):
            if block[position:match.start()].strip():
                return text, []
            name = (match.group("v3") or match.group("v31") or "").strip()
            arguments = match.group("v3args") if match.group("v3") else match.group("v31args")
            call = _object_call({"name": name, "arguments": (arguments or "").strip()}, self.names, "arguments")
            if call is None:
                return text, []
            calls.append(call)
            position = match.end()
        if not calls or block[position:].strip():
            return text, []
        return text[:at].strip(), calls

    def stream(self) -> "_TailBlockStream":
        return _TailBlockStream(self, self.START)


class _TailBlockStream:
    """Content streams until the start of the calls block (a tail that may begin it is held back);
    from there everything is held and read at the end."""

    def __init__(self, parser: DeepSeekParser, start: str) -> None:
        self.parser = parser
        self.start = start
        self.buffer = ""
        self.inside = False

    def feed(self, delta: str) -> list[str | ToolCall]:
        self.buffer += delta
        if self.inside:
            return []
        at = self.buffer.find(self.start)
        if at >= 0:
            self.inside = True
            out, self.buffer = self.buffer[:at], self.buffer[at:]
            return [out] if out else []
        keep = next((k for k in range(min(len(self.start) - 1, len(self.buffer)), 0, -1)
                     if self.start.startswith(self.buffer[-k:])), 0)
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return [out] if out else []

    def finish(self) -> list[str | ToolCall]:
        rest, self.buffer = self.buffer, ""
        if not rest:
            return []
        if not self.inside:
            return [rest]
        content, calls = self.parser.parse(rest)
        return [*([content] if content else []), *calls]


class GptOssParser:
    """gpt-oss (OpenAI's harmony format): the output is messages, each a header, `<|message|>` and a
    body ended by `<|end|>`, `<|call|>` or `<|return|>` (the last two are end-of-sequence tokens,
    which the engine trims: the output's end ends a body too). The header names the channel
    (`<|channel|>analysis`, `commentary` or `final`) and, for a call, its recipient (`to=functions.NAME`,
    in the role part or after the channel), then `<|constrain|>json` or `json` before the arguments.
    An output without harmony markers is all content."""

    MESSAGE = "<|message|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    START = "<|start|>"
    _RECIPIENT = re.compile(r"\bto=([A-Za-z_][\w.\-]*)")
    _CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return _parsed_by_stream(self.stream(), text)

    def stream(self) -> "_HarmonyStream":
        return _HarmonyStream(self)

    def kind(self, header: str) -> tuple[str, str]:
        """("call", tool name), ("content", ""), ("reasoning", "") or ("unknown", "") for a message's header."""
        recipient = self._RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1).removeprefix("functions.")
            return ("call", name) if name in self.names else ("unknown", "")
        channel = self._CHANNEL.search(header)
        if channel is None or channel.group(1) in ("final", "commentary"):
            return "content", ""
        return ("reasoning", "") if channel.group(1) == "analysis" else ("unknown", "")

    def call(self, name: str, body: str) -> ToolCall | None:
        return _object_call({"name": name, "arguments": body.strip() or "{}"}, self.names, "arguments")


def _held_tail(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the beginning of one of `markers`."""
    return max((k for marker in markers for k in range(min(len(marker) - 1, len(text)), 0, -1)
                if marker.startswith(text[-k:])), default=0)


class _HarmonyStream:
    """Reads harmony messages as they come: content bodies stream (a tail that may begin a marker
    held back), a call's body is held until it ends, reasoning is dropped."""

    def __init__(self, parser: GptOssParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.mode = "start"  # start (undecided), plain, header, body
        self.header = ""
        self.kind, self.name = "content", ""

    def feed(self, delta: str) -> list[str | ToolCall]:
        self.buffer += delta
        out: list[str | ToolCall] = []
        while True:
            if self.mode == "plain":
                out.append(self.buffer)
                self.buffer = ""
                return out
            if self.mode == "start":
                head = self.buffer.lstrip()
                if not head:
                    return out
                if head.startswith("<|"):
                    self.mode = "header"
                elif not "<|".startswith(head):
                    self.mode = "plain"
                else:
                    return out
            if self.mode == "header":
                at = self.buffer.find(GptOssParser.MESSAGE)
                if at < 0:
                    return out
                self.header = self.buffer[:at + len(GptOssParser.MESSAGE)]
                self.buffer = self.buffer[at + len(GptOssParser.MESSAGE):]
                self.kind, self.name = self.parser.kind(self.header)
                self.mode = "body"
            ends = [(at, marker) for marker in (*GptOssParser.ENDS, GptOssParser.START)
                    if (at := self.buffer.find(marker)) >= 0]
            if not ends:
                if self.kind == "content":
                    keep = _held_tail(self.buffer, (*GptOssParser.ENDS, GptOssParser.START))
                    text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if text:
                        out.append(text)
                return out
            at, marker = min(ends)
            body = self.buffer[:at]
            # `<|start|>` begins the next message's header; an end marker is consumed.
            self.buffer = self.buffer[at:] if marker == GptOssParser.START else self.buffer[at + len(marker):]
            out.extend(self._close(body, marker if marker != GptOssParser.START else ""))
            self.mode = "header"

    def _close(self, body: str, end: str) -> list[str | ToolCall]:
        if self.kind == "content":
            return [body] if body else []
        if self.kind == "reasoning":
            return []
        if self.kind == "call":
            call = self.parser.call(self.name, body)
            if call is not None:
                return [call]
        return [self.header + body + end]  # not a call of an offered tool: as the model wrote it

    def finish(self) -> list[str | ToolCall]:
        rest, self.buffer = self.buffer, ""
        if self.mode == "body":
            self.mode = "header"
            return self._close(rest, "")
        return [rest] if rest.strip() else []


PARSERS: dict[str, type[Llama3Parser] | type[HermesParser] | type[MistralParser] | type[PythonicParser]
              | type[DeepSeekParser] | type[GptOssParser]] = {
    "llama3": Llama3Parser, "hermes": HermesParser, "qwen25": HermesParser, "qwen": HermesParser,
    "mistral": MistralParser, "pythonic": PythonicParser, "deepseekv3": DeepSeekParser, "deepseekv31": DeepSeekParser,
    "gpt-oss": GptOssParser,
}
# Families whose call markers are special tokens the engine leaves out of its text by default
# (SGLang's `skip_special_tokens`): their parser needs them kept.
KEEPS_SPECIAL_TOKENS = frozenset({"gpt-oss"})
# Families whose chat templates take only call ids of their own shape (Mistral's: 9 letters and digits).
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def family_of_template(template: str | None) -> str | None:
    """The tool-call family a chat template writes past calls in (the model writes its calls the
    same way), from the family's markers; None when it shows none (`INFERBUS_TOOL_CALL_PARSER=auto`)."""
    if not template:
        return None
    if "<|channel|>" in template and "<|message|>" in template:
        return "gpt-oss"
    if "<｜tool▁sep｜>" in template:
        return "deepseekv3" if "```json" in template else "deepseekv31"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_start|>" in template:
        return "pythonic"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3"
    return None


def call_id(family: str) -> str:
    """A new call id in the shape the family's template accepts back: Mistral's 9 characters, else OpenAI's."""
    if family == "mistral":
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


def parser_for(family: str, tools: Sequence[dict[str, Any]]) -> Parser:
    names = frozenset(t["function"]["name"] for t in tools)
    return PARSERS[family](names)


def _leading_items(text: str) -> list[Any]:
    """The complete items at the start of a JSON array that was cut short (by max_tokens)."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    items: list[Any] = []
    position = 1
    while True:
        while position < len(body) and body[position] in " \t\r\n,":
            position += 1
        try:
            item, position = _decoder.raw_decode(body, position)
        except ValueError:
            return items
        items.append(item)


def _calls_of_cut_array(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The complete calls of a list of calls cut short; None if it holds none or anything else."""
    calls = [_object_call(item, names, "parameters") for item in _leading_items(text)]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


class ConstrainedStream:
    """The output of a forced call (`constraint`): JSON only, read when complete."""

    def __init__(self, tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any]) -> None:
        self.name = forced_name(tool_choice)
        self.names = frozenset(t["function"]["name"] for t in tools)
        self.buffer = ""

    def feed(self, delta: str) -> list[str | ToolCall]:
        self.buffer += delta
        return []

    def finish(self) -> list[str | ToolCall]:
        text, self.buffer = self.buffer, ""
        try:
            value = json.loads(text)
        except ValueError:
            # Cut short by max_tokens: the calls completed before the cut, else what there is as content.
            complete = _calls_of_cut_array(text, self.names) if self.name is None else None
            return list(complete) if complete else ([text] if text else [])
        if self.name is not None:
            if isinstance(value, dict):
                return [ToolCall(name=self.name, arguments=json.dumps(value, ensure_ascii=False))]
            return [text]
        calls = [_object_call(item, self.names, "parameters") for item in value] if isinstance(value, list) else [None]
        if not calls or any(c is None for c in calls):
            return [text]
        return [c for c in calls if c is not None]


class EitherStream:
    """The output under `either_constraint`: a JSON array of calls (held until complete), or the
    answer's JSON, which is content and streams as it comes."""

    def __init__(self, tools: Sequence[dict[str, Any]]) -> None:
        self.names = frozenset(t["function"]["name"] for t in tools)
        self.buffer = ""
        self.held = False
        self.streaming = False

    def feed(self, delta: str) -> list[str | ToolCall]:
        if self.streaming:
            return [delta]
        self.buffer += delta
        head = self.buffer.lstrip()
        if self.held or not head:
            return []
        if head[0] == "[":  # calls, or an answer that is an array: decided when complete
            self.held = True
            return []
        self.streaming = True
        out, self.buffer = self.buffer, ""
        return [out]

    def finish(self) -> list[str | ToolCall]:
        text, self.buffer = self.buffer, ""
        if not text:
            return []
        try:
            value = json.loads(text)
        except ValueError:
            complete = _calls_of_cut_array(text, self.names) if self.held else None
            return list(complete) if complete else [text]  # cut short: the complete calls, if any
        if isinstance(value, list) and value:
            calls = [_object_call(item, self.names, "parameters") for item in value]
            if all(call is not None for call in calls):
                return [call for call in calls if call is not None]
        return [text]


class ToolOutput:
    """One choice's output when tools are in play: text deltas in, content and calls out.

    `parallel` False keeps only the first call, as OpenAI's `parallel_tool_calls: false` promises.
    """

    def __init__(self, family: str, tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any] | None,
                 parallel: bool = True, json_answer: bool = False) -> None:
        self.family = family
        forced = tool_choice == "required" or isinstance(tool_choice, dict)
        self.stream: Stream
        if forced:
            self.stream = ConstrainedStream(tools, tool_choice)  # type: ignore[arg-type]
        elif json_answer:  # a JSON response_format beside the tools: either_constraint
            self.stream = EitherStream(tools)
        else:
            self.stream = parser_for(family, tools).stream()
        self.parallel = parallel
        self.calls: list[ToolCall] = []

    def _keep(self, parts: list[str | ToolCall]) -> list[str | ToolCall]:
        kept: list[str | ToolCall] = []
        for part in parts:
            if isinstance(part, ToolCall):
                if self.calls and not self.parallel:
                    continue
                part = replace(part, id=call_id(self.family))
                self.calls.append(part)
            elif not part:
                continue
            kept.append(part)
        return kept

    def feed(self, delta: str) -> list[str | ToolCall]:
        return self._keep(self.stream.feed(delta))

    def finish(self) -> list[str | ToolCall]:
        return self._keep(self.stream.finish())

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output, for non-streaming responses."""
        parts = [*self.feed(text), *self.finish()]
        content = "".join(p for p in parts if isinstance(p, str))
        calls = [p for p in parts if isinstance(p, ToolCall)]
        if calls:
            content = content.strip()
        return (content or None) if calls else content, calls
