"""Mix requests → request bodies whose prompts have the intended token counts.

Text is one token per word under `inferbus.tokens.blocks` (the simulated engine's tokenizer): five-letter
words with a leading space. A request's first `cached_tokens` tokens are a prefix shared by every
request of its class (a per-class "system prompt"), so a prefix cache hits as the mix says; the rest
is unique to the request. On chat endpoints the Llama-3 template wraps the content (as the gateway
and the simulated engine render it); its tokens count towards the prompt, so the content is
shortened by them. On a real server with another tokenizer the counts are approximate: the sweep
reports the server's usage numbers, not these.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from typing import Any

from inferbus.tokens.blocks import count_tokens
from inferbus.tokens.blocks import standin_render_chat as render_chat
from tools.capacity.mix import MixRequest
from tools.capacity.traces import word

ENDPOINTS = ("chat", "completions")
ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}


# A vocabulary of its own (another multiplier and offset than trace prompts use), one token per word.
WORDS = tuple(word(i, 7907, 101) for i in range(4096))


def words(rng: random.Random, count: int) -> str:
    """`count` tokens of text (one word per token)."""
    return "".join(rng.choices(WORDS, k=count))


@dataclass(frozen=True, slots=True)
class Prepared:
    """One request ready to send: its body, its class and the lengths it asks for."""

    kind: str
    body: bytes
    prompt_tokens: int  # intended prompt tokens under inferbus.tokens.blocks (template included)
    output_tokens: int
    cached_tokens: int


class PromptBuilder:
    """Builds request bodies for one endpoint, model and run (deterministic per seed)."""

    def __init__(self, endpoint: str, model: str, *, ignore_eos: bool = True, seed: int = 0,
                 extra_body: dict[str, Any] | None = None) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        self.endpoint = endpoint
        self.model = model
        self.ignore_eos = ignore_eos
        self.seed = seed
        self.extra_body = dict(extra_body or {})
        self._prefixes: dict[str, str] = {}
        self._prefix_tokens: dict[str, int] = {}
        if endpoint == "chat":
            # Template tokens before the content (shared by every request) and after it.
            marker = " zzzzz"
            rendered = render_chat([{"role": "user", "content": marker}])
            head_text = rendered[: rendered.index(marker)]
            self.head_tokens = count_tokens(head_text)
            self.template_tokens = count_tokens(rendered) - 1
        else:
            self.head_tokens = 0
            self.template_tokens = 0

    def _class_prefix(self, kind: str, tokens: int) -> str:
        """The first `tokens` tokens of the class's shared prefix (longer ones extend shorter ones)."""
        if tokens <= 0:
            return ""
        if self._prefix_tokens.get(kind, 0) < tokens:
            rng = random.Random(zlib.crc32(f"{self.seed}:{kind}".encode()))
            self._prefixes[kind] = words(rng, tokens)
            self._prefix_tokens[kind] = tokens
        return self._prefixes[kind][: 6 * tokens]  # every word is 6 characters

    def content(self, request: MixRequest, nonce: str) -> tuple[str, int]:
        """The prompt content for `request` and the total prompt tokens it makes."""
        content_tokens = max(1, request.input_tokens - self.template_tokens)
        shared = max(0, min(content_tokens - 1, request.cached_tokens - self.head_tokens))
        rng = random.Random(zlib.crc32(f"{self.seed}:{nonce}".encode()))
        text = self._class_prefix(request.kind, shared) + words(rng, content_tokens - shared)
        return text, content_tokens + self.template_tokens

    def prepare(self, request: MixRequest, nonce: str) -> Prepared:
        """A streaming request body for `request`; `nonce` makes its unique part unique."""
        text, prompt_tokens = self.content(request, nonce)
        body: dict[str, Any] = {"model": self.model}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        body.update({
            "max_tokens": request.output_tokens, "stream": True, "stream_options": {"include_usage": True},
        })
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return Prepared(request.kind, json.dumps(body).encode(), prompt_tokens, request.output_tokens,
                        min(request.cached_tokens, prompt_tokens - 1))

    def probe(self) -> bytes:
        """A one-token request that checks URL, model, endpoint and key before a sweep."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": 1, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": "Say hi."}]
        else:
            body["prompt"] = "Say hi."
        body.update(self.extra_body)
        return json.dumps(body).encode()
