"""Builds a tiny model directory that real SGLang can serve on a CPU, and LoRA adapters for it.

No model hub is reachable, so everything is made here: a byte-level BPE tokenizer trained with
`tokenizers` on the Python standard library's sources, a ChatML-style chat template (deliberately
not Llama-3's) in `tokenizer_config.json`, a 2-layer Llama with random weights saved by
`transformers`, a LoRA adapter made with `peft`, and an adapter SGLang must refuse (rank above
the engine's `--max-lora-rank`).

`build_tokenizer` needs only `tokenizers`; the weights and adapters need torch, transformers and
peft (the SGLang environment has them). Run as a script with that environment's Python:

    python tests/sglang/modeldir.py OUT_DIR

which writes OUT_DIR/model, OUT_DIR/lora and OUT_DIR/bad-lora, then OUT_DIR/.built last.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 2048
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LORA_RANK = 4
BAD_LORA_RANK = 16  # above the engine's --max-lora-rank 8
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
CORPUS_BYTES = 2_000_000


def training_corpus(limit: int = CORPUS_BYTES) -> list[str]:
    """The standard library's own sources, in a fixed order, up to `limit` bytes."""
    texts: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    return texts


def build_tokenizer(out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2))


def build_model(out: Path) -> None:
    """A 2-layer Llama with random weights (seeded) next to the tokenizer."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tokenizer.token_to_id(BOS), eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD), torch_dtype="bfloat16", tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def build_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> None:
    """A LoRA adapter on q/k/v/o with non-zero B (so its output differs from the base model's)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, init_lora_weights=False,
                        task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(str(out))


def build(out: Path) -> None:
    build_tokenizer(out / "model")
    build_model(out / "model")
    build_adapter(out / "model", out / "lora", LORA_RANK, seed=1)
    build_adapter(out / "model", out / "bad-lora", BAD_LORA_RANK, seed=2)
    (out / ".built").write_text("ok\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]))
