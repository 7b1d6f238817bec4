"""The served model's own tokenizer and chat template, loaded from its model directory.

A model directory is what the engine serves (a Hugging Face model repository on disk):
`tokenizer.json` for the `tokenizers` library and a Jinja `chat_template` in
`tokenizer_config.json` (or `chat_template.jinja`). Prompts are rendered the way Hugging Face's
`apply_chat_template` renders them (a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, `raise_exception`, `tojson`, `strftime_now`, the special tokens as variables,
`messages`, `tools`, `add_generation_prompt`), then tokenized once. The gateway and the batch
service call `render_prompt`, and the token ids travel on the bus: what the
engine computes on is what was counted, billed and hashed.

We use `tokenizers` + `jinja2` rather than `transformers`: the same files and semantics without a
framework import on every service (transformers costs seconds and hundreds of MB to import; the two
libraries cost ~50 ms).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from inferbus.tokens.blocks import content_text

# Above this many characters a prompt is tokenized without holding the GIL (about 1 ms of work).
LONG_TEXT_CHARS = 4096


class PromptError(ValueError):
    """The request cannot be rendered with this model's template (the client's mistake: a 400)."""


class ModelDirError(RuntimeError):
    """The model directory is missing a file or has one that cannot be used (an operator's mistake)."""


@dataclass(frozen=True)
class Prompt:
    text: str  # as rendered, for logs and engines that take text
    ids: list[int]  # what the engine computes on


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' override: Jinja's own `tojson` escapes HTML characters, which templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken mapping."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


class ServedModel:
    """Tokenizer and chat template of one served model."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special_tokens: dict[str, str | None],
                 eos_token_ids: list[int], path: str = "", context_length: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length  # from config.json, as the engine derives it; None: not given
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self.path = path
        self._template = _compile(chat_template) if chat_template else None
        # A template that never names the `developer` role has no turn for it: OpenAI's developer
        # message is what the system message was before its reasoning models, so it is sent as one.
        self.has_developer_role = bool(chat_template) and "developer" in (chat_template or "")

    @classmethod
    def load(cls, path: str | Path) -> ServedModel:
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelDirError(f"{directory}: no tokenizer.json (a model directory as the engine serves it is needed)")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        template: Any = config.get("chat_template")
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # several named templates: the default one is the chat template
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        generation = _read_json(directory / "generation_config.json")
        model_config = _read_json(directory / "config.json")
        eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not eos_ids and special["eos_token"]:
            token_id = tokenizer.token_to_id(special["eos_token"])
            eos_ids = [token_id] if token_id is not None else []
        return cls(tokenizer, template, special, eos_ids, str(directory), context_length(model_config))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None, *,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The chat as the model's template writes it (transformers' `apply_chat_template(tokenize=False)`)."""
        if self._template is None:
            raise PromptError("This model has no chat template; use /v1/completions with a prompt.")
        template = self._template
        normalized = [_text_message(message, self.has_developer_role) for message in messages]

        # A token the model does not have is left undefined (renders empty), as transformers does.
        tokens = {name: token for name, token in self.special_tokens.items() if token is not None}

        def render(chat: list[dict[str, Any]]) -> str:
            return template.render(
                messages=chat, tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt,
                **tokens, **template_kwargs,
            )

        try:
            return render(normalized)
        except jinja2.TemplateError as error:
            refusal = error
        # OpenAI accepts any number of system messages anywhere; many templates take one, first
        # (Mistral's, Gemma's). Those get all the system text in that one message.
        folded = _one_system_message(normalized)
        if folded is not None:
            try:
                return render(folded)
            except jinja2.TemplateError:
                pass
        raise PromptError(f"The messages do not fit this model's chat template: {refusal}") from None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            # `encode_batch` releases the GIL (`encode` does not): a caller that runs a long prompt
            # in a thread keeps its event loop serving meanwhile.
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _text_message(message: Mapping[str, Any], has_developer_role: bool) -> dict[str, Any]:
    """A message with its content parts joined into one string (text-only models; as SGLang does
    for templates that expect string content), and `developer` sent as `system` to a template
    without that role."""
    normalized = dict(message)
    if "content" in normalized and not isinstance(normalized["content"], str | None):
        normalized["content"] = content_text(normalized["content"])
    if normalized.get("role") == "developer" and not has_developer_role:
        normalized["role"] = "system"
    return normalized


def _one_system_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The chat with all its system messages joined into one at the start (a blank line between
    them); None when it already has at most one, first."""
    system = [i for i, message in enumerate(messages) if message.get("role") == "system"]
    if not system or system == [0]:
        return None
    text = "\n\n".join(messages[i].get("content") or "" for i in system)
    return [{"role": "system", "content": text}, *(message for message in messages if message.get("role") != "system")]


# SGLang's context length for a config.json that gives none.
DEFAULT_CONTEXT_LENGTH = 2048


def context_window(configured: int, model: ServedModel, engines: int = 0) -> int:
    """The context window requests must fit: the configured one (INFERBUS_MAX_MODEL_LEN), else the
    smallest the engines report (`engines`, 0: none known; an engine started with --context-length),
    else the model's own, else SGLang's default."""
    return configured or engines or model.context_length or DEFAULT_CONTEXT_LENGTH


# The keys of config.json that give the context length, in the order SGLang reads them.
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def context_length(config: Mapping[str, Any]) -> int | None:
    """The model's context length from its config.json, as SGLang derives it (`--context-length`
    unset): the first of CONTEXT_LENGTH_KEYS, times a RoPE scaling factor unless the scaling is
    Llama-3's or keeps the original length; a multimodal model's `text_config`. None if absent."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    assert isinstance(text, Mapping)
    scaling = text.get("rope_scaling")
    factor = 1.0
    if isinstance(scaling, Mapping) and "original_max_position_embeddings" not in scaling \
            and scaling.get("rope_type", scaling.get("type")) != "llama3":
        factor = float(scaling.get("factor", 1.0))
    for key in CONTEXT_LENGTH_KEYS:
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return int(factor * value)
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelDirError(f"{path}: {error}") from None
    return value if isinstance(value, dict) else {}


def render_prompt(model: ServedModel, *, messages: Sequence[Mapping[str, Any]] | None = None,
                  tools: Sequence[Any] | None = None, prompt: str | Sequence[int] | None = None,
                  **template_kwargs: Any) -> Prompt:
    """The one rendering of a request, for the gateway and the batch service alike: chat `messages`
    (and `tools`) through the model's template, or a completion `prompt`; tokenized once.

    A chat template writes its special tokens itself, so the rendered text is encoded without
    adding any (transformers' `apply_chat_template(tokenize=True)` does the same). A completion's
    text is encoded with the tokenizer's special tokens (the BOS token of models that have one), as
    SGLang and vLLM do for `/v1/completions`; a completion given as token ids passes unchanged.
    Raises PromptError when the messages do not fit the template (a 400 for the client).
    """
    if messages is not None:
        text = model.render_chat(messages, tools, **template_kwargs)
        return Prompt(text, model.encode(text, add_special_tokens=False))
    if isinstance(prompt, str):
        return Prompt(prompt, model.encode(prompt, add_special_tokens=True))
    if prompt is None:
        raise PromptError("A request needs `messages` or `prompt`.")
    ids = list(prompt)
    return Prompt(model.decode(ids), ids)


@lru_cache(maxsize=8)
def load_model(path: str) -> ServedModel:
    """One ServedModel per directory per process (the `INFERBUS_MODEL_DIR` setting)."""
    if not path:
        raise ModelDirError(
            "INFERBUS_MODEL_DIR is not set: point it at the served model's directory (tokenizer.json, "
            "tokenizer_config.json), the one the engines load; `python -m inferbus.tokens.modeldir DIR` writes a small "
            "one"
        )
    return ServedModel.load(path)
