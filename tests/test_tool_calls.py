"""Tool-call parsers of each model family, whole and streamed, and the forced-call constraint."""

from __future__ import annotations

import json

import jsonschema
import pytest

from inferbus.openai import tools
from inferbus.openai.errors import OpenAIError
from inferbus.openai.tools import HermesParser, Llama3Parser, ToolCall, ToolOutput

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = frozenset({"get_weather", "get_time"})


def _streamed(output: ToolOutput, text: str, step: int) -> list[str | ToolCall]:
    parts: list[str | ToolCall] = []
    for i in range(0, len(text), step):
        parts += output.feed(text[i:i + step])
    return parts + output.finish()


def _shape(parts: list[str | ToolCall]) -> tuple[str, list[tuple[str, dict]]]:
    return ("".join(p for p in parts if isinstance(p, str)),
            [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)])


def test_llama3_json_calls_with_python_tag_and_semicolons() -> None:
    parser = Llama3Parser(NAMES)
    content, calls = parser.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                  '{"name": "get_time", "parameters": {}}')
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("text", [
    'The weather is fine.',
    '{"name": "get_weather", "parameters": {"city": "Oslo"',  # cut short
    '{"name": "launch_rockets", "parameters": {}}',  # not an offered tool
    '{"name": "get_weather", "parameters": [1]}',  # arguments not an object
])
def test_llama3_anything_else_is_content(text: str) -> None:
    assert Llama3Parser(NAMES).parse(text) == (text, [])


def test_hermes_blocks_among_text() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    content, calls = HermesParser(NAMES).parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_malformed_block_stays_content() -> None:
    text = "<tool_call>{not json}</tool_call>"
    assert HermesParser(NAMES).parse(text) == (text, [])


@pytest.mark.parametrize("family, text", [
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("hermes", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    ("llama3", "Plain words, no call at all."),
    ("hermes", "A < b and <tool_ but no call."),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_parts_equal_the_whole_parse(family: str, text: str, step: int) -> None:
    whole = ToolOutput(family, [WEATHER, TIME], "auto")
    streamed = ToolOutput(family, [WEATHER, TIME], "auto")
    content, calls = whole.whole(text)
    got_content, got_calls = _shape(_streamed(streamed, text, step))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == got_calls
    assert (content or "") == (got_content.strip() if got_calls else got_content)


def test_plain_content_streams_before_the_end() -> None:
    output = ToolOutput("hermes", [WEATHER], "auto")
    assert output.feed("Hello there") == ["Hello there"]
    output = ToolOutput("llama3", [WEATHER], "auto")
    assert output.feed("Hello") == ["Hello"]


def test_parallel_false_keeps_the_first_call() -> None:
    output = ToolOutput("llama3", [WEATHER, TIME], "auto", parallel=False)
    content, calls = output.whole(
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "x"}}'
    )
    assert [c.name for c in calls] == ["get_time"] and content is None


def test_forced_calls_read_the_constrained_json() -> None:
    named = ToolOutput("hermes", [WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert _shape(_streamed(named, '{"city": "Rome"}', 2))[1] == [("get_weather", {"city": "Rome"})]
    required = ToolOutput("llama3", [WEATHER, TIME], "required")
    _, calls = required.whole('[{"name": "get_time", "parameters": {}}]')
    assert [c.name for c in calls] == ["get_time"]
    cut = ToolOutput("llama3", [WEATHER], "required")
    assert cut.whole('[{"name": "get_wea') == ('[{"name": "get_wea', [])


def test_constraint_schemas_accept_exactly_valid_calls() -> None:
    schema = tools.constraint([WEATHER, TIME], "required", parallel=False)
    assert schema is not None
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tools.constraint([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, True) == \
        WEATHER["function"]["parameters"]
    assert tools.constraint([WEATHER], "auto", True) is None


@pytest.mark.parametrize("tool_list, choice, param", [
    ([{"type": "function"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], None,
     "tools[0].function.parameters"),
    (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(tool_list: list | None, choice: object, param: str) -> None:
    with pytest.raises(OpenAIError) as raised:
        tools.check(tool_list, choice)  # type: ignore[arg-type]
    assert raised.value.status == 400 and raised.value.param == param



def test_engine_constraint_of_a_request() -> None:
    import msgspec

    from inferbus.openai.sampling import sampling_params
    from inferbus.openai.schemas import parse_chat, parse_completion

    def chat(**fields: object) -> object:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
        return sampling_params(parse_chat(msgspec.json.encode(body)), 16)

    assert chat().json_schema is None and chat(response_format={"type": "text"}).json_schema is None
    assert chat(response_format={"type": "json_object"}).json_schema == '{"type":"object"}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
                      .json_schema) == schema
    # A forced call wins over the response format; auto leaves the model free.
    forced = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  response_format={"type": "json_object"})
    assert json.loads(forced.json_schema) == WEATHER["function"]["parameters"]
    assert chat(tools=[WEATHER], tool_choice="auto").json_schema is None
    # With tools the model may call and a JSON response format: calls or the answer, its choice.
    for choice in ({}, {"tool_choice": "auto"}):
        either = json.loads(chat(tools=[WEATHER, TIME], response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": schema}}, **choice).json_schema)
        assert either == {"anyOf": [tools.constraint([WEATHER, TIME], "required", True), schema]}
        jsonschema.validate([{"name": "get_time", "parameters": {}}], either)
        jsonschema.validate({"a": 1}, either)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "get_weather", "parameters": {}}], either)  # city is required
    one = json.loads(
        chat(tools=[WEATHER], parallel_tool_calls=False, response_format={"type": "json_object"}).json_schema
    )
    assert one["anyOf"][0]["maxItems"] == 1 and one["anyOf"][1] == {"type": "object"}
    assert chat(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"}).json_schema == \
        '{"type":"object"}'
    sampled = chat(seed=9, top_k=0, min_p=0.2, logprobs=True, top_logprobs=4)
    assert (sampled.seed, sampled.top_k, sampled.min_p, sampled.logprobs, sampled.top_logprobs) == (9, -1, 0.2, True, 4)
    completion = sampling_params(parse_completion(b'{"model": "m", "prompt": "x", "logprobs": 0}'), 8)
    assert completion.logprobs and completion.top_logprobs == 0


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_calls_or_the_answer_read_from_the_either_constraint(step: int) -> None:
    def output() -> ToolOutput:
        return ToolOutput("hermes", [WEATHER, TIME], "auto", json_answer=True)

    calls = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    assert _shape(_streamed(output(), calls, step)) == ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    answer = '{"city": "Oslo", "summary": "cold"}'
    assert _shape(_streamed(output(), answer, step)) == (answer, [])
    # The answer streams as it is generated; an array is held until it is known not to be calls.
    streaming = output()
    assert streaming.feed('{"city"') == ['{"city"'] and streaming.feed(": 1}") == [": 1}"]
    array = '[{"name": "someone else", "parameters": {}}]'
    assert _shape(_streamed(output(), array, step)) == (array, [])
    single = ToolOutput("llama3", [WEATHER, TIME], None, parallel=False, json_answer=True)
    assert _shape(_streamed(single, calls, step))[1] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
    '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',  # marker dropped
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',  # Small 3.2 / Magistral
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_mistral_calls_with_nine_character_ids(text: str, step: int) -> None:
    output = ToolOutput("mistral", [WEATHER, TIME], "auto")
    assert _shape(_streamed(output, text, step)) == ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    # Mistral's templates refuse any other id when the tool results come back.
    assert all(len(call.id) == 9 and call.id.isalnum() for call in output.calls)
    assert len({call.id for call in output.calls}) == 2


@pytest.mark.parametrize("text", ["[TOOL_CALLS] [{\"name\": \"nope\", \"arguments\": {}}]", "[1, 2]", "Sure: [x]",
                                  "[TOOL_CALLS]get_weather[ARGS]{broken"])
def test_mistral_anything_else_is_content(text: str) -> None:
    assert tools.MistralParser(NAMES).parse(text) == (text, [])


@pytest.mark.parametrize("text", [
    '[get_weather(city="Oslo"), get_time()]',
    '<|python_start|>[get_weather(city="Oslo"), get_time()]<|python_end|>',
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_pythonic_calls(text: str, step: int) -> None:
    output = ToolOutput("pythonic", [WEATHER, TIME], "auto")
    assert _shape(_streamed(output, text, step)) == ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    assert all(call.id.startswith("call_") for call in output.calls)


@pytest.mark.parametrize("text", ["[get_weather('Oslo')]", "[os.system(x='rm')]", "[nope(a=1)]",
                                  "[get_weather(city=open('x'))]", "It is [sunny].", "[get_weather(city="])
def test_pythonic_anything_else_is_content(text: str) -> None:
    assert tools.PythonicParser(NAMES).parse(text) == (text, [])
    output = ToolOutput("pythonic", [WEATHER, TIME], "auto")
    assert _shape(_streamed(output, text, 2)) == (text, [])


def test_every_family_reads_what_the_simulated_model_writes() -> None:
    import random

    from inferbus.tokens.blocks import standin_render_chat
    from services.sim_engine.constrained import FAMILIES, tool_call_output

    prompt = standin_render_chat([{"role": "user", "content": "The weather in Oslo, and the time?"}], [WEATHER, TIME])
    assert set(FAMILIES) == set(tools.PARSERS)
    for family in FAMILIES:
        written = tool_call_output(prompt, family, random.Random(1))
        assert written is not None
        content, calls = ToolOutput(family, [WEATHER, TIME], "auto").whole(written)
        assert [c.name for c in calls] == ["get_weather", "get_time"] and content is None, family


V3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      '{"city": "Oslo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```'
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V31 = ("Let me check.<｜tool▁calls▁begin｜>"
       '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
       "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


@pytest.mark.parametrize(("family", "text"), [("deepseekv3", V3), ("deepseekv31", V31)])
@pytest.mark.parametrize("step", [1, 6, 1000])
def test_deepseek_calls_after_content(family: str, text: str, step: int) -> None:
    output = ToolOutput(family, [WEATHER, TIME], "auto")
    parts = _streamed(output, text, step)
    assert _shape(parts) == ("Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    # The content streams before the block; the block is held until it is complete.
    early = ToolOutput(family, [WEATHER, TIME], "auto")
    assert "".join(str(p) for p in early.feed(text[:text.index("<")])) == "Let me check."
    assert early.feed(text[text.index("<"):-3]) == []


@pytest.mark.parametrize("text", ["Just text, no tools.", V31.replace("get_weather", "nope"),
                                  V31.replace('{"city": "Oslo"}', "{broken")])
def test_deepseek_anything_else_is_content(text: str) -> None:
    assert tools.DeepSeekParser(NAMES).parse(text) == (text, [])
    assert _shape(_streamed(ToolOutput("deepseekv31", [WEATHER, TIME], "auto"), text, 5)) == (text, [])


def test_a_list_of_calls_cut_short_keeps_its_complete_calls() -> None:
    cut = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "param'
    for output in (ToolOutput("llama3", [WEATHER, TIME], "required"), ToolOutput("hermes", [WEATHER, TIME], None,
                                                                                 json_answer=True)):
        assert _shape(_streamed(output, cut, 7)) == ("", [("get_weather", {"city": "Oslo"})])
    # Nothing complete, or a complete item that is not a call: what there is, as content.
    for text in ('[{"name": "get_weather", "param', '[{"name": "nope", "parameters": {}}, {"na'):
        assert _shape(_streamed(ToolOutput("llama3", [WEATHER, TIME], "required"), text, 7)) == (text, [])


# gpt-oss writes OpenAI's harmony format: after the generation prompt `<|start|>assistant`, messages
# of a channel, a call being a message to `functions.NAME` (recipient in the channel header or the
# role part), its end-of-sequence token `<|call|>` trimmed by the engine or not.
HARMONY_CALLS = [
    "<|channel|>analysis<|message|>The user wants weather and time.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather '
    '<|constrain|>json<|message|>{"city":"Oslo"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
    "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}",
]


@pytest.mark.parametrize("text", HARMONY_CALLS)
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_gpt_oss_calls_in_harmony_messages(text: str, step: int) -> None:
    output = ToolOutput("gpt-oss", [WEATHER, TIME], "auto")
    assert _shape(_streamed(output, text, step)) == ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    assert all(call.id.startswith("call_") for call in output.calls)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_gpt_oss_final_channel_is_content_and_streams(step: int) -> None:
    text = ("<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final<|message|>"
            "It is sunny in Oslo.<|return|>")
    assert _shape(_streamed(ToolOutput("gpt-oss", [WEATHER], "auto"), text, step)) == ("It is sunny in Oslo.", [])
    # The answer streams as it comes; the reasoning never shows.
    early = ToolOutput("gpt-oss", [WEATHER], "auto")
    assert "".join(str(p) for p in early.feed(text[:-len("Oslo.<|return|>")])) == "It is sunny in "
    assert tools.GptOssParser(NAMES).parse("Plain text, no harmony.") == ("Plain text, no harmony.", [])


@pytest.mark.parametrize("text", [
    '<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{"a":1}<|call|>',
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{broken<|call|>',
    '<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=browser.search json<|message|>{}',
])
def test_gpt_oss_anything_else_is_content(text: str) -> None:
    content, calls = tools.GptOssParser(NAMES).parse(text)
    assert calls == [] and "to=" in content and "analysis" not in content


def test_gpt_oss_keeps_the_engines_special_tokens_only_when_it_reads_calls() -> None:
    from inferbus.openai.sampling import sampling_params
    from inferbus.openai.schemas import parse_chat
    from services.worker.engine import generate_body

    def keeps(body: dict, family: str) -> bool:
        sampling = sampling_params(parse_chat(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                          **body}).encode()), 16, family)
        return not sampling.skip_special_tokens

    assert keeps({"tools": [WEATHER]}, "gpt-oss")
    assert not keeps({"tools": [WEATHER]}, "llama3")
    assert not keeps({}, "gpt-oss")
    assert not keeps({"tools": [WEATHER], "tool_choice": "required"}, "gpt-oss")  # constrained JSON, no markers

    from proto import messages as m

    request = m.InferenceRequest(
        request_id="r",
        tenant="t",
        model="m",
        prompt="p",
        reply_to="x",
        deadline=0.0,
        created=0.0,
        sampling=m.SamplingParams(max_new_tokens=4, skip_special_tokens=False),
    )
    assert generate_body(request)["sampling_params"]["skip_special_tokens"] is False
    plain = m.InferenceRequest(
        request_id="r",
        tenant="t",
        model="m",
        prompt="p",
        reply_to="x",
        deadline=0.0,
        created=0.0,
        sampling=m.SamplingParams(max_new_tokens=4),
    )
    assert "skip_special_tokens" not in generate_body(plain)["sampling_params"]


def test_the_family_of_a_chat_template() -> None:
    """INFERBUS_TOOL_CALL_PARSER=auto: the family whose call markers the template writes past calls in
    (fragments shaped like each family's template)."""
    from inferbus.tokens.modeldir import FORMATS

    assert tools.family_of_template(FORMATS["llama3"].template) == "llama3"
    assert tools.family_of_template(FORMATS["chatml"].template) == "hermes"
    assert tools.family_of_template('{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}') == "mistral"
    assert tools.family_of_template("{{- '<|python_start|>' }}{%- for tc in message.tool_calls %}") == "pythonic"
    v3 = "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json'}}"
    v31 = "{{'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments']}}"
    assert tools.family_of_template(v3) == "deepseekv3" and tools.family_of_template(v31) == "deepseekv31"
    harmony = '{{- "<|start|>assistant to=functions." + tool_call.name + "<|channel|>commentary json<|message|>" }}'
    assert tools.family_of_template(harmony) == "gpt-oss"
    assert tools.family_of_template("{{ messages }}") is None and tools.family_of_template(None) is None
