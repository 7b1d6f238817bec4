"""Canonical prompt rendering: chat messages rendered the way the engine sees them.

The gateway renders once and the rendered text travels on the bus, so the router (prefix
hashing), the worker and the engine all see the same string. The format is Llama-3's chat
template, the family our base model belongs to.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

BEGIN = "<|begin_of_text|>"
END_OF_TURN = "<|eot_id|>"


def _header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def content_text(content: Any) -> str:
    """Text of a message's `content`: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def render_chat(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> str:
    """Render chat messages (and tool definitions) into one prompt ending at the assistant's turn."""
    parts = [BEGIN]
    if tools:
        # Tools go into the system turn in a stable order so equal tool sets share a prefix.
        parts.append(_header("system"))
        parts.append("Tools available:\n" + json.dumps(list(tools), sort_keys=True, separators=(",", ":")))
        parts.append(END_OF_TURN)
    for message in messages:
        parts.append(_header(message["role"]))
        parts.append(content_text(message.get("content")))
        for call in message.get("tool_calls") or ():
            parts.append(json.dumps(call, sort_keys=True, separators=(",", ":")))
        parts.append(END_OF_TURN)
    parts.append(_header("assistant"))
    return "".join(parts)
