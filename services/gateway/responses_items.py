"""OpenAI's Responses API as a translation onto chat completions, as pure functions.

A Responses request becomes the chat-completions request the gateway already runs (so admission,
quotas, placement, migration and billing are the chat path's), and the chat result (a
`chat.completion`, or its chunks) becomes a `response` object or the Responses stream's typed
events. Wire format: OpenAI's API reference for `POST /v1/responses` and its streaming events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from inferbus.openai.errors import OpenAIError
from inferbus.openai.jsonschemas import check_json_schema
from inferbus.openai.schemas import Temperature, TopP, _decode

Item = dict[str, Any]
Event = tuple[str, dict[str, Any]]


class TextConfig(msgspec.Struct, forbid_unknown_fields=False):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # no padding is ever added; either value is accepted


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An unknown top-level field is a 400 naming it, as OpenAI answers (see inferbus.openai.schemas)."""

    model: str
    input: str | list[Item] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[Item] | None = None
    tool_choice: str | Item | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True  # as OpenAI's: responses are stored unless asked not to
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    stream_options: ResponsesStreamOptions | None = None
    prompt_cache_key: str | None = None  # hints for OpenAI's prompt cache; the prefix cache needs none
    prompt_cache_retention: str | None = None
    # Parts of the API this platform does not build: refused with a 400 naming them when set.
    background: bool | None = None
    conversation: Any = None
    reasoning: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    service_tier: str | None = None


_decoder = msgspec.json.Decoder(ResponsesRequest)
_ROLES = ("user", "system", "developer", "assistant")
_TOOL_CHOICES = ("none", "auto", "required")


def _unsupported(what: str, param: str) -> OpenAIError:
    return OpenAIError(400, f"{what} is not supported by this server.", param=param, code="unsupported_value")


def _invalid(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def parse_request(body: bytes) -> ResponsesRequest:
    """Decode and check a `POST /v1/responses` body; OpenAIError 400 for anything wrong or not built."""
    request: ResponsesRequest = _decode(_decoder, body)
    if request.background:
        raise _unsupported("Background mode (`background: true`)", "background")
    if request.conversation is not None:
        raise _unsupported("The Conversations API (`conversation`); use `previous_response_id`", "conversation")
    if _set(request.reasoning):
        raise _unsupported("Reasoning options (`reasoning`)", "reasoning")
    if request.prompt is not None:
        raise _unsupported("Prompt templates (`prompt`)", "prompt")
    if request.max_tool_calls is not None:
        raise _unsupported("`max_tool_calls`", "max_tool_calls")
    if request.top_logprobs:
        raise _unsupported("Log probabilities (`top_logprobs`)", "top_logprobs")
    if request.context_management is not None:
        raise _unsupported("`context_management`", "context_management")
    if request.service_tier not in (None, "auto", "default"):
        raise _unsupported(f"`service_tier: {request.service_tier}` (the band comes from the API key)", "service_tier")
    if request.text is not None and request.text.verbosity is not None:
        raise _unsupported("`text.verbosity`", "text.verbosity")
    if request.truncation == "auto":
        raise _unsupported("`truncation: auto`", "truncation")
    for i, name in enumerate(request.include or ()):
        raise _unsupported(f"`include` value '{name}'", f"include[{i}]")
    if request.metadata is not None and len(request.metadata) > 16:
        raise _invalid("metadata may have at most 16 keys.", "metadata")
    if request.input is None and request.previous_response_id is None:
        raise OpenAIError(400, "Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    if isinstance(request.input, list) and not request.input and request.previous_response_id is None:
        raise _invalid("input must contain at least one item.", "input")
    for i, tool in enumerate(request.tools or ()):
        _check_tool(tool, i)
    _check_tool_choice(request.tool_choice)
    _check_format(request.text.format if request.text else None)
    return request


def _set(value: Any) -> bool:
    """True if an options object asks for anything (`{"effort": null}` asks for nothing)."""
    if isinstance(value, dict):
        return any(_set(v) for v in value.values())
    return value is not None


def _check_tool(tool: Item, i: int) -> None:
    kind = tool.get("type")
    if kind != "function":
        raise _unsupported(f"The tool type '{kind}' (only function tools are built)", f"tools[{i}].type")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise OpenAIError(400, "Missing required parameter: 'tools[{i}].name'.".format(i=i), param=f"tools[{i}].name",
                          code="missing_required_parameter")
    if tool.get("parameters") is not None:
        if not isinstance(tool["parameters"], dict):
            raise _invalid("A function's parameters must be a JSON Schema object.", f"tools[{i}].parameters")
        check_json_schema(tool["parameters"], f"tools[{i}].parameters")


def _check_tool_choice(choice: str | Item | None) -> None:
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise _invalid(f"tool_choice must be one of {', '.join(_TOOL_CHOICES)} or a function.", "tool_choice")
        return
    kind = choice.get("type")
    if kind != "function":
        raise _unsupported(f"tool_choice of type '{kind}'", "tool_choice")
    if not isinstance(choice.get("name"), str):
        raise OpenAIError(400, "Missing required parameter: 'tool_choice.name'.", param="tool_choice.name",
                          code="missing_required_parameter")


def _check_format(fmt: dict[str, Any] | None) -> None:
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return
    if kind != "json_schema":
        raise _unsupported(f"text.format of type '{kind}'", "text.format.type")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise OpenAIError(400, "Missing required parameter: 'text.format.name'.", param="text.format.name",
                          code="missing_required_parameter")
    if not isinstance(fmt.get("schema"), dict):
        raise OpenAIError(400, "Missing required parameter: 'text.format.schema'.", param="text.format.schema",
                          code="missing_required_parameter")
    check_json_schema(fmt["schema"], "text.format.schema")


# ---- input items ------------------------------------------------------------------------------


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items(request: ResponsesRequest, id_suffix: str) -> list[Item]:
    """The request's `input` as stored input items (OpenAI's shapes, every item with an id: its
    own, or `<msg|fc|fco>_<id_suffix>_<position>`)."""
    raw: list[Item] = (
        [{"type": "message", "role": "user", "content": request.input}]
        if isinstance(request.input, str)
        else list(request.input or ())
    )
    return [_input_item(item, i, f"{id_suffix}_{i}") for i, item in enumerate(raw)]


def _text_of(content: Any, param: str, allowed: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid("content must be a string or a list of content parts.", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise _unsupported(f"Content part type '{kind}' (text parts only)", f"{param}[{j}].type")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise OpenAIError(400, f"Missing required parameter: '{param}[{j}].text'.", param=f"{param}[{j}].text",
                              code="missing_required_parameter")
        texts.append(text)
    return "".join(texts)


def _input_item(item: Any, i: int, id_suffix: str) -> Item:
    param = f"input[{i}]"
    if not isinstance(item, dict):
        raise _invalid("Each input item must be an object.", param)
    kind = item.get("type", "message")
    item_id = f"{_ID_PREFIXES.get(kind, 'item')}_{id_suffix}"
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise _invalid(f"role must be one of {', '.join(_ROLES)}.", f"{param}.role")
        if role == "assistant":
            text = _text_of(item.get("content"), f"{param}.content", ("output_text", "input_text", "text", "refusal"))
            content = [{"type": "output_text", "text": text, "annotations": []}]
        else:
            text = _text_of(item.get("content"), f"{param}.content", ("input_text", "text"))
            content = [{"type": "input_text", "text": text}]
        return {
            "id": item.get("id") or item_id,
            "type": "message",
            "role": role,
            "content": content,
            "status": "completed",
        }
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise OpenAIError(400, f"Missing required parameter: '{param}.{name}'.", param=f"{param}.{name}",
                                  code="missing_required_parameter")
        return {"id": item.get("id") or item_id, "type": "function_call", "call_id": item["call_id"],
                "name": item["name"], "arguments": item["arguments"], "status": "completed"}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise OpenAIError(400, f"Missing required parameter: '{param}.call_id'.", param=f"{param}.call_id",
                              code="missing_required_parameter")
        output = _text_of(item.get("output"), f"{param}.output", ("input_text", "output_text", "text"))
        return {"id": item.get("id") or item_id, "type": "function_call_output", "call_id": item["call_id"],
                "output": output, "status": "completed"}
    raise _unsupported(f"The input item type '{kind}'", f"{param}.type")


def check_call_outputs(conversation: list[Item], first_input: int) -> None:
    """Every `function_call_output` answers a `function_call` made before it (400 otherwise, as
    OpenAI's); `first_input` is where the request's own input starts in the conversation."""
    calls: set[str] = set()
    for position, item in enumerate(conversation):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise _invalid(f"No function call found for the function_call_output with call_id '{item['call_id']}'.",
                           f"input[{position - first_input}].call_id" if position >= first_input else "input")


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """Chat messages for a conversation's items: a function call joins the assistant turn before
    it, as the model produced them together, so the rendered prompt extends the previous one."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions request body that runs `request`."""
    body: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (("max_completion_tokens", request.max_output_tokens), ("temperature", request.temperature),
                        ("top_p", request.top_p), ("parallel_tool_calls", request.parallel_tool_calls),
                        ("user", request.user), ("safety_identifier", request.safety_identifier)):
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
                },
            }
            for tool in request.tools
        ]
    if isinstance(request.tool_choice, str):
        body["tool_choice"] = request.tool_choice
    elif request.tool_choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice["name"]}}
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt["type"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt["type"] == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}}
    return body


def responses_param(param: str | None) -> str | None:
    """A chat-completions error's `param` in the Responses request's terms."""
    if param is None:
        return None
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param.startswith("messages"):
        return "input"  # the chat messages also hold instructions and earlier responses' items
    if param.startswith("response_format"):
        return "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
    return re.sub(r"^(tools\[\d+\]|tool_choice)\.function", r"\1", param)


# ---- the response object ----------------------------------------------------------------------


@dataclass(frozen=True)
class Shell:
    """What a response object says about its request, whatever its output."""

    id: str
    created_at: int
    model: str
    request: ResponsesRequest

    def body(self, status: str, output: list[Item], usage: dict[str, Any] | None = None,
             incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "max_tool_calls": None,
            "model": self.model, "output": output,
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": r.store, "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": (r.text.format if r.text and r.text.format else {"type": "text"})},
            "tool_choice": "auto" if r.tool_choice is None else r.tool_choice, "tools": _tools_out(r.tools),
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled", "usage": usage,
            "user": r.user, "safety_identifier": r.safety_identifier, "metadata": r.metadata or {},
        }


def _tools_out(tools: list[Item] | None) -> list[Item]:
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in tools or ()]


def usage_body(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Responses usage for chat usage (`input_tokens_details.cached_tokens` = prefix-cache hits)."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]}


def _status(finish: str | None) -> tuple[str, str | None]:
    return ("incomplete", "max_output_tokens") if finish == "length" else ("completed", None)


def _message_item(item_id: str, text: str, status: str) -> Item:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def response_from_chat(shell: Shell, completion: dict[str, Any]) -> dict[str, Any]:
    """The `response` object for a finished `chat.completion`."""
    choice = completion["choices"][0]
    message = choice["message"]
    output: list[Item] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(_message_item(f"msg_{shell.id[5:]}_0", message.get("content") or "", "completed"))
    for call in calls:
        output.append(_call_item(f"fc_{shell.id[5:]}_{len(output)}", call["id"], call["function"]["name"],
                                 call["function"]["arguments"], "completed"))
    status, incomplete = _status(choice.get("finish_reason"))
    return shell.body(status, output, usage_body(completion.get("usage")), incomplete)


# ---- the stream -------------------------------------------------------------------------------


@dataclass
class _Open:
    """The output item being streamed: a message (its text so far) or a function call."""

    index: int
    item: Item
    tool_index: int | None = None


@dataclass
class StreamTranslator:
    """Chat-completion chunks in, the Responses stream's typed events out, in OpenAI's order:
    `response.created`, `response.in_progress`, then per output item `output_item.added`, its
    deltas, its `.done` events and `output_item.done`, and last `response.completed` (or
    `response.incomplete` / `response.failed`)."""

    shell: Shell
    sequence: int = 0
    output: list[Item] = field(default_factory=list)
    current: _Open | None = None
    finish: str | None = None
    usage: dict[str, Any] | None = None
    final: dict[str, Any] | None = None  # the response object, once the stream ended

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, event

    def start(self) -> list[Event]:
        created = self.shell.body("in_progress", [])
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[Event]:
        """Events for one `chat.completion.chunk` (or the stream's error object)."""
        if "error" in chunk:
            return self._fail(chunk["error"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[Event] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def _open_message(self) -> list[Event]:
        events = self._close()
        item = _message_item(f"msg_{self.shell.id[5:]}_{len(self.output)}", "", "in_progress")
        self.current = _Open(len(self.output), item)
        events.append(self._event("response.output_item.added", output_index=self.current.index,
                                  item={**item, "content": []}))
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.current.index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        return events

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.current is None or self.current.item["type"] != "message":
            events += self._open_message()
        assert self.current is not None
        part = self.current.item["content"][0]
        part["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self.current.item["id"],
                                  output_index=self.current.index, content_index=0, delta=text, logprobs=[]))
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        index = call.get("index", 0)
        if self.current is None or self.current.tool_index != index:
            events += self._close()
            function = call.get("function") or {}
            item = _call_item(f"fc_{self.shell.id[5:]}_{len(self.output)}", call.get("id") or "",
                              function.get("name") or "", "", "in_progress")
            self.current = _Open(len(self.output), item, tool_index=index)
            events.append(self._event("response.output_item.added", output_index=self.current.index, item=dict(item)))
        arguments = (call.get("function") or {}).get("arguments")
        if arguments:
            self.current.item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=self.current.item["id"],
                                      output_index=self.current.index, delta=arguments))
        return events

    def _close(self) -> list[Event]:
        open_item, self.current = self.current, None
        if open_item is None:
            return []
        item, index = open_item.item, open_item.index
        item["status"] = "completed"
        events: list[Event] = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def end(self) -> list[Event]:
        """The closing events once the chat stream ended (`[DONE]`)."""
        if self.final is not None:
            return []
        events = []
        if not self.output and self.current is None:  # nothing generated: still one (empty) message
            events += self._open_message()
        events += self._close()
        status, incomplete = _status(self.finish)
        self.final = self.shell.body(status, self.output, usage_body(self.usage), incomplete)
        events.append(self._event(f"response.{status}", response=self.final))
        return events


    def _fail(self, error: dict[str, Any]) -> list[Event]:
        if self.final is not None:
            return []
        code = error.get("code") or error.get("type") or "server_error"
        events = [self._event("error", code=code, message=error.get("message", ""), param=error.get("param"))]
        if self.current is not None:
            self.current.item["status"] = "incomplete"
            self.output.append(self.current.item)
            self.current = None
        self.final = self.shell.body("failed", self.output, usage_body(self.usage),
                                     error={"code": code, "message": error.get("message", "")})
        events.append(self._event("response.failed", response=self.final))
        return events


def sse(event: Event) -> bytes:
    kind, data = event
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"
