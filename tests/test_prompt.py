"""The served model's own tokenizer and chat template (inferbus.prompt), on model directories built
by inferbus.modeldir: a Llama-3-style model and a ChatML one, rendered as apply_chat_template does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inferbus.modeldir import build_model_dir
from inferbus.prompt import ModelDirError, PromptError, ServedModel, load_model, render_prompt

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_llama3_template_renders_turns_tools_and_tool_results(llama3_model_dir: Path) -> None:
    model = load_model(str(llama3_model_dir))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": " in Oslo?"}]},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    prompt = render_prompt(model, messages=messages, tools=TOOLS)
    assert prompt.text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\n")
    assert '"description": "Weather <now> & later"' in prompt.text  # tojson without HTML escaping
    assert "<|start_header_id|>user<|end_header_id|>\n\nWeather in Oslo?<|eot_id|>" in prompt.text
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>' in prompt.text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n12 C<|eot_id|>" in prompt.text
    assert prompt.text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    # Tokenized once, special tokens as single ids and none added (the template wrote the BOS).
    bos = model.tokenizer.token_to_id("<|begin_of_text|>")
    assert prompt.ids[0] == bos and prompt.ids.count(bos) == 1
    assert prompt.ids.count(model.tokenizer.token_to_id("<|eot_id|>")) == 4
    assert model.decode(prompt.ids) == model.tokenizer.decode(prompt.ids)


def test_chatml_template_works_unchanged_and_has_no_bos(chatml_model_dir: Path) -> None:
    model = load_model(str(chatml_model_dir))
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "12 C"}, {"role": "tool", "content": "dry"}]
    text = render_prompt(model, messages=messages, tools=TOOLS).text
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    # Consecutive tool results share one user turn.
    assert "<|im_start|>user\n<tool_response>\n12 C\n</tool_response>\n<tool_response>\ndry\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert render_prompt(model, messages=[{"role": "user", "content": "hi"}]).text == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.eos_token_ids == [model.tokenizer.token_to_id("<|im_end|>"), model.tokenizer.token_to_id("<|endoftext|>")]


def test_completion_prompts_get_the_tokenizers_special_tokens(llama3_model_dir: Path, chatml_model_dir: Path) -> None:
    llama, chatml = load_model(str(llama3_model_dir)), load_model(str(chatml_model_dir))
    assert render_prompt(llama, prompt="def f():").ids[0] == llama.tokenizer.token_to_id("<|begin_of_text|>")
    assert render_prompt(chatml, prompt="def f():").ids == chatml.encode("def f():", add_special_tokens=False)
    long = "def f(x):\n    return x + 1\n" * 400  # tokenized without the GIL: the same ids
    assert render_prompt(llama, prompt=long).ids == llama.tokenizer.encode(long, add_special_tokens=True).ids
    ids = render_prompt(chatml, prompt="x = 1").ids
    assert render_prompt(chatml, prompt=ids).ids == ids and render_prompt(chatml, prompt=ids).text == "x = 1"


def test_what_the_template_refuses_is_a_prompt_error(llama3_model_dir: Path) -> None:
    model = load_model(str(llama3_model_dir))
    with pytest.raises(PromptError, match="system message must come first"):
        render_prompt(model, messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(PromptError, match="Unknown message role: wizard"):
        render_prompt(model, messages=[{"role": "wizard", "content": "a"}])


def test_the_template_is_sandboxed(tmp_path: Path, llama3_model_dir: Path) -> None:
    directory = tmp_path / "model"
    shutil.copytree(llama3_model_dir, directory)
    (directory / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")  # wins over tokenizer_config
    with pytest.raises(PromptError):
        render_prompt(ServedModel.load(directory), messages=[{"role": "user", "content": "a"}])


def test_a_directory_without_a_tokenizer_or_setting_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="INFERBUS_MODEL_DIR is not set"):
        load_model("")
    with pytest.raises(ModelDirError, match="no tokenizer.json"):
        load_model(str(tmp_path))


def test_model_directories_are_deterministic_and_cached(tmp_path: Path, llama3_model_dir: Path) -> None:
    again = build_model_dir(tmp_path / "again", "llama3")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (llama3_model_dir / name).read_bytes()
    config = json.loads((again / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["bos_token"] == "<|begin_of_text|>"
    assert json.loads((again / "config.json").read_text())["vocab_size"] >= load_model(str(again)).vocab_size
    with pytest.raises(ValueError, match="chat_format"):
        build_model_dir(tmp_path / "x", "mistral")
