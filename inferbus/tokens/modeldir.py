"""Build a small model directory with a real tokenizer and chat template, without a model hub.

A model directory is what an engine serves and what the gateway reads its tokenizer and chat
template from: `tokenizer.json` (Hugging Face `tokenizers`), `tokenizer_config.json` (special
tokens and the Jinja `chat_template`), `config.json` and `generation_config.json`. Weights are not
written here: the simulated engine needs none, and a real engine's tiny random weights are saved
next to these files by `transformers` where it is installed.

The tokenizer is a byte-level BPE trained with `tokenizers` on local text (the Python standard
library's sources), so it needs no download. Training is deterministic and cached, keyed by its
parameters and the corpus, so a second build of the same kind costs a file copy.

Two chat formats are provided, so nothing downstream can assume one: `llama3` (header tokens,
`<|eot_id|>`, a BOS token, JSON tool calls) and `chatml` (Qwen's `<|im_start|>`/`<|im_end|>`, no
BOS token, `<tool_call>` tags).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Byte-level BPE on the corpus tops out near 29k tokens. Text then takes about as many tokens as
# the stand-in tokenizer the capacity tools size prompts with (2.5 against 2.4 per word on this
# repository's README; 3.5 with a 2048-token vocabulary).
DEFAULT_VOCAB_SIZE = 32_000
# Enough text for these vocabularies; more only slows training (about 3 s, once: it is cached).
_CORPUS_BYTES = 3_000_000


@dataclass(frozen=True)
class ChatFormat:
    name: str
    bos_token: str | None
    eos_token: str  # ends an assistant turn; generation stops there
    pad_token: str
    special_tokens: tuple[str, ...]  # added tokens, never split by the BPE
    extra_eos_tokens: tuple[str, ...]  # generation_config's other stop tokens
    architecture: str
    template: str


# Llama-3-style: the prompt starts with the BOS token, turns are headed by role tokens and end
# with <|eot_id|>; tools go into the system turn, a tool call is a JSON object on its own. A later
# system message is a system turn where it stands, as in Llama-3.3's own template.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
    {%- set ns = namespace(system=messages[0].content) %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set ns = namespace(system='') %}
{%- endif %}
{%- if tools %}
    {%- if ns.system %}{%- set ns.system = ns.system + '\n\n' %}{%- endif %}
    {%- set ns.system = ns.system + 'You can call these functions. To call one, answer only with JSON: '
        + '{"name": <function name>, "parameters": <arguments as a JSON object>}.\n\n' %}
    {%- for tool in tools %}
        {%- set ns.system = ns.system + (tool | tojson(indent=4)) + '\n\n' %}
    {%- endfor %}
{%- endif %}
{%- if ns.system %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' + ns.system | trim + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- '<|start_header_id|>system<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if message.content is string %}{{- message.content }}{%- else %}{{- message.content | tojson }}{%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'user' or message.role == 'assistant' %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content or '') | trim
            + '<|eot_id|>' }}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# ChatML (Qwen-style): no BOS token, <|im_start|>role ... <|im_end|>; tools listed in the system
# turn inside <tools>, calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results
# sent back in a user turn inside <tool_response>. A later system message is a system turn where it
# stands, as in Qwen2.5's own template.
CHATML_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions. Their signatures are inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each call, answer with a JSON object inside <tool_call></tool_call> tags:\n<tool_call>\n'
        + '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system'
        or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

FORMATS: dict[str, ChatFormat] = {
    "llama3": ChatFormat(
        name="llama3",
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        special_tokens=(
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>",
        ),
        extra_eos_tokens=("<|end_of_text|>", "<|eom_id|>"),
        architecture="LlamaForCausalLM",
        template=LLAMA3_TEMPLATE,
    ),
    "chatml": ChatFormat(
        name="chatml",
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
        extra_eos_tokens=("<|endoftext|>",),
        architecture="LlamaForCausalLM",  # the template is what differs; tiny test weights stay Llama-shaped
        template=CHATML_TEMPLATE,
    ),
}


def _corpus_files() -> list[Path]:
    """The standard library's top-level modules in name order, about `_CORPUS_BYTES` of them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total >= _CORPUS_BYTES:
            break
    if not files:
        raise RuntimeError(f"no Python sources under {stdlib} to train a tokenizer on")
    return files


def cache_dir() -> Path:
    """Where trained tokenizers are kept: $INFERBUS_CACHE_DIR, else $XDG_CACHE_HOME/inferbus, else the temp dir."""
    configured = os.environ.get("INFERBUS_CACHE_DIR")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "inferbus"
    return Path(tempfile.gettempdir()) / f"inferbus-cache-{os.getuid()}"


def _train_tokenizer(chat_format: ChatFormat, vocab_size: int) -> str:
    """tokenizer.json text of a byte-level BPE trained on the corpus, cached by parameters."""
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    files = _corpus_files()
    key_source = json.dumps(
        {
            "format": chat_format.name,
            "special": chat_format.special_tokens,
            "bos": chat_format.bos_token,
            "vocab": vocab_size,
            "tokenizers": tokenizers.__version__,
            "python": sys.version_info[:2],
            "corpus": [(path.name, path.stat().st_size) for path in files],
        },
        sort_keys=True,
    )
    key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / f"{chat_format.name}-{vocab_size}-{key}.json"
    if cached.exists():
        return cached.read_text()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(chat_format.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(path) for path in files], trainer)
    if chat_format.bos_token:
        bos_id = tokenizer.token_to_id(chat_format.bos_token)
        # A raw completion prompt gets the BOS token, as Llama-3's own tokenizer.json does; chat
        # templates write it themselves and are encoded without special tokens.
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{chat_format.bos_token} $A",
            pair=f"{chat_format.bos_token} $A {chat_format.bos_token} $B",
            special_tokens=[(chat_format.bos_token, bos_id)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    text = tokenizer.to_str()
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(text)
    partial.replace(cached)  # atomic: concurrent builders never read half a file
    return text


def build_model_dir(
    path: str | os.PathLike[str],
    chat_format: str = "llama3",
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_max_length: int = 131_072,
) -> Path:
    """Write a model directory at `path` (created if needed) and return it.

    `chat_format` is `llama3` or `chatml`. The files are those a Hugging Face model repository has
    for its tokenizer and configuration, loadable by `transformers.AutoTokenizer` and by
    `inferbus.tokens.prompt.ServedModel`.
    """
    if chat_format not in FORMATS:
        raise ValueError(f"chat_format must be one of {sorted(FORMATS)}, got {chat_format!r}")
    spec = FORMATS[chat_format]
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer_text = _train_tokenizer(spec, vocab_size)
    (target / "tokenizer.json").write_text(tokenizer_text)

    vocab = json.loads(tokenizer_text)["added_tokens"]
    ids = {token["content"]: token["id"] for token in vocab}
    added_tokens_decoder = {
        str(ids[token]): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for token in spec.special_tokens
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": spec.bos_token,
        "eos_token": spec.eos_token,
        "pad_token": spec.pad_token,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": spec.template,
    }
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (target / "special_tokens_map.json").write_text(
        json.dumps(
            {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "pad_token") if tokenizer_config[k]}, indent=2
        )
        + "\n"
    )

    eos_ids = [ids[spec.eos_token], *(ids[token] for token in spec.extra_eos_tokens)]
    bos_id = ids[spec.bos_token] if spec.bos_token else None
    # A tiny Llama-shaped configuration: what a real engine loads with random test weights.
    config = {
        "architectures": [spec.architecture],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": model_max_length,  # the context length engines and the gateway read
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0],
        "pad_token_id": ids[spec.pad_token],
    }
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_ids, "pad_token_id": ids[spec.pad_token]}
    (target / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m inferbus.tokens.modeldir",
        description="Write a small model directory (tokenizer trained on local text, chat template, configs).",
    )
    parser.add_argument("path", help="Directory to write (created if missing).")
    parser.add_argument("--format", choices=sorted(FORMATS), default="llama3", help="Chat template family.")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="BPE vocabulary size.")
    args = parser.parse_args(argv)
    print(build_model_dir(args.path, args.format, vocab_size=args.vocab_size))


if __name__ == "__main__":
    main()
