"""Builds the model real SGLang serves in the contract suite, and LoRA adapters for it.

No model hub is reachable, so everything is made here. The tokenizer, chat template (ChatML, so
nothing can assume Llama-3's) and configuration come from `inferbus.tokens.modeldir`, exactly as the
simulated engine and the gateway get them; this adds what only a real engine needs: a 2-layer
Llama with seeded random weights saved by `transformers`, a LoRA adapter made with `peft`
(non-zero B, so its output differs from the base model's), the same adapter padded to take a
while to load, and an adapter SGLang must refuse (rank above the engine's `--max-lora-rank`). Run with SGLang's Python
(it has torch, transformers and peft), the repository on its path:

    PYTHONPATH=. python tests/sglang/modeldir.py OUT_DIR

which writes OUT_DIR/model, OUT_DIR/lora, OUT_DIR/slow-lora and OUT_DIR/bad-lora, then OUT_DIR/.built last.
"""

from __future__ import annotations

import sys
from pathlib import Path

from inferbus.tokens.modeldir import build_model_dir

CHAT_FORMAT = "chatml"
LORA_RANK = 4
BAD_LORA_RANK = 16  # above the engine's --max-lora-rank 8
SLOW_PAD_BYTES = 768 * 2**20
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build_weights(model_dir: Path) -> None:
    """Random weights (seeded) for the configuration `inferbus.tokens.modeldir` wrote."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(str(model_dir))
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(model_dir), safe_serialization=True)


def build_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, init_lora_weights=False,
                        task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(str(out))


def build_slow_adapter(adapter: Path, out: Path) -> None:
    """The adapter again, in PyTorch's format (`adapter_model.bin`) with a tensor of `SLOW_PAD_BYTES`
    no module uses: SGLang reads the whole file (`torch.load`; safetensors it would map, reading
    only the tensors it touches) and keeps only its modules' tensors, so the load takes a
    measurable time on any machine."""
    import shutil

    import torch
    from safetensors.torch import load_file

    shutil.copytree(adapter, out)
    weights = load_file(str(out / "adapter_model.safetensors"))
    weights["padding"] = torch.ones(SLOW_PAD_BYTES // 2, dtype=torch.bfloat16)
    torch.save(weights, str(out / "adapter_model.bin"))
    (out / "adapter_model.safetensors").unlink()


def build(out: Path) -> None:
    model = build_model_dir(out / "model", CHAT_FORMAT, model_max_length=4096)
    build_weights(model)
    build_adapter(model, out / "lora", LORA_RANK, seed=1)
    build_adapter(model, out / "bad-lora", BAD_LORA_RANK, seed=2)
    build_slow_adapter(out / "lora", out / "slow-lora")
    (out / ".built").write_text("ok\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]))
