"""The served model's own tokenizer and chat template (inferbus.tokens.prompt), on model directories built
by inferbus.tokens.modeldir: a Llama-3-style model and a ChatML one, rendered as apply_chat_template does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inferbus.tokens.modeldir import build_model_dir
from inferbus.tokens.prompt import ModelDirError, PromptError, ServedModel, load_model, render_prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_llama3_template_renders_turns_tools_and_tool_results(llama3_model_dir: Path) -> None:
    model = load_model(str(llama3_model_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": " in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]
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
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "12 C"},
        {"role": "tool", "content": "dry"},
    ]
    text = render_prompt(model, messages=messages, tools=TOOLS).text
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Oslo"}}\n</tool_call><|im_end|>'
        in text
    )
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n12 C\n</tool_response>\n<tool_response>\ndry\n</tool_response><|im_end|>\n"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert render_prompt(model, messages=[{"role": "user", "content": "hi"}]).text == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.eos_token_ids == [
        model.tokenizer.token_to_id("<|im_end|>"),
        model.tokenizer.token_to_id("<|endoftext|>"),
    ]


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
    with pytest.raises(PromptError, match="Unknown message role: wizard"):
        render_prompt(model, messages=[{"role": "wizard", "content": "a"}])


# Shaped like Mistral-7B-Instruct-v0.3's template: one optional leading system message (put before
# the last user turn), then strictly alternating user/assistant turns; anything else is refused.
ONE_SYSTEM_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate '
            + 'user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""


def _with_template(tmp_path: Path, source: Path, template: str) -> ServedModel:
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    (directory / "chat_template.jinja").write_text(template)
    return ServedModel.load(directory)


def test_developer_messages_are_system_messages_to_templates_without_that_role(
        tmp_path: Path, llama3_model_dir: Path, chatml_model_dir: Path) -> None:
    for directory in (llama3_model_dir, chatml_model_dir):
        model = load_model(str(directory))
        as_developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        assert render_prompt(model, messages=as_developer) == render_prompt(model, messages=as_system)
    # A template that has the role gets it as sent.
    knows = _with_template(tmp_path, chatml_model_dir,
                           "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{# roles: system, developer, user, assistant #}")
    assert knows.render_chat([{"role": "developer", "content": "x"}]) == "<|im_start|>developer\nx<|im_end|>\n"


def test_several_and_later_system_messages_render_where_they_stand(
    llama3_model_dir: Path, chatml_model_dir: Path
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Answer in JSON."}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "{}"},
        {"role": "developer", "content": "Now in French."},
        {"role": "user", "content": "again"},
    ]
    llama = render_prompt(load_model(str(llama3_model_dir)), messages=messages).text
    assert llama == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>system<|end_header_id|>\n\nAnswer in JSON.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{}<|eot_id|>"
        "<|start_header_id|>system<|end_header_id|>\n\nNow in French.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    chatml = render_prompt(load_model(str(chatml_model_dir)), messages=messages, tools=TOOLS).text
    assert chatml.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert chatml.endswith(
        "<|im_start|>system\nAnswer in "
        "JSON.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"
        "<|im_start|>system\nNow in French.<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_takes_one_system_message_gets_them_all_in_it(tmp_path: Path, llama3_model_dir: Path) -> None:
    model = _with_template(tmp_path, llama3_model_dir, ONE_SYSTEM_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in JSON."},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "{}"},
                {"role": "system", "content": "Now in French."}, {"role": "user", "content": "again"}]
    assert model.render_chat(messages) == (
        "<|begin_of_text|>[INST] hi[/INST] {}<|eot_id|>[INST] Be brief.\n\nAnswer in JSON.\n\nNow in "
        "French.\n\nagain[/INST]")
    # What the template refuses for another reason is still refused, with its own words.
    with pytest.raises(PromptError, match="roles must alternate"):
        model.render_chat([{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                           {"role": "assistant", "content": "c"}])


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


@pytest.mark.slow
def test_model_directories_are_deterministic_and_cached(tmp_path: Path, llama3_model_dir: Path) -> None:
    again = build_model_dir(tmp_path / "again", "llama3")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (llama3_model_dir / name).read_bytes()
    config = json.loads((again / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["bos_token"] == "<|begin_of_text|>"
    assert json.loads((again / "config.json").read_text())["vocab_size"] >= load_model(str(again)).vocab_size
    with pytest.raises(ValueError, match="chat_format"):
        build_model_dir(tmp_path / "x", "mistral")


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_rendering_equals_transformers(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Text and ids as transformers' apply_chat_template gives them, for the shapes OpenAI clients send
    (where a message needs mapping, transformers is given what the template receives)."""
    transformers = pytest.importorskip("transformers")
    directory: Path = request.getfixturevalue(f"{family}_model_dir")
    model = load_model(str(directory))
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    one_system = _with_template(tmp_path, directory, ONE_SYSTEM_TEMPLATE)
    reference_one_system = transformers.AutoTokenizer.from_pretrained(str(one_system.path))
    chats = [
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "system", "content": "Answer in JSON."},
                {"role": "user", "content": "hi"},
            ],
            None,
        ),
        (
            [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
                {"role": "system", "content": "Now in French."},
                {"role": "user", "content": "Again"},
            ],
            TOOLS,
        ),
    ]
    for messages, tools in chats:
        ours = render_prompt(model, messages=messages, tools=tools)
        theirs = reference.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.text == theirs
        assert ours.ids == reference(theirs, add_special_tokens=False)["input_ids"]
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render_prompt(model, messages=developer).text == reference.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tokenize=False,
        add_generation_prompt=True)
    folded = [{"role": "system", "content": "Be brief.\n\nAnswer in JSON."}, {"role": "user", "content": "hi"}]
    assert one_system.render_chat(chats[0][0]) == reference_one_system.apply_chat_template(
        folded, tokenize=False, add_generation_prompt=True)


def test_the_context_length_is_read_from_config_json_as_sglang_reads_it(llama3_model_dir: Path) -> None:
    from inferbus.tokens.prompt import context_length, context_window

    assert load_model(str(llama3_model_dir)).context_length == 131_072  # what build_model_dir wrote
    assert context_length({"max_position_embeddings": 32_768}) == 32_768
    assert context_length({"seq_length": 8192, "max_position_embeddings": 4096}) == 8192  # SGLang's key order
    assert (
        context_length({"max_position_embeddings": 32_768, "rope_scaling": {"type": "yarn", "factor": 4.0}}) == 131_072
    )
    assert context_length({"max_position_embeddings": 131_072,
                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == 131_072
    assert context_length({"max_position_embeddings": 131_072, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768}}) == 131_072
    assert context_length({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert context_length({}) is None
    model = load_model(str(llama3_model_dir))
    assert context_window(1024, model) == 1024 and context_window(0, model) == 131_072
    assert context_window(0, ServedModel(model.tokenizer, None, {}, [])) == 2048  # SGLang's default
