"""The Responses API (`/v1/responses`) with the official openai SDK and the OpenAI Agents SDK
against a running platform (two simulated workers writing Llama-3 JSON tool calls)."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from .conftest import MODEL, Platform, on_both_topologies, read_usage
from .waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def platform(request: pytest.FixtureRequest, platform: Platform) -> Platform:
    """Every test here runs on aggregated workers and on a prefill/decode pair (`--prefill 1 --decode 1`)."""
    return on_both_topologies(request, platform)

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}
LONG_INSTRUCTIONS = "You are a careful assistant of the inferbus platform team; answer briefly. " * 20


@pytest.fixture
def client(platform: Platform) -> openai.OpenAI:
    return platform.client()


def other_tenant(platform: Platform, **fields: object) -> openai.OpenAI:
    tenant = "t-" + secrets.token_hex(4)
    with platform.admin() as admin:
        assert admin.post("/tenants", json={"id": tenant, **fields}).status_code in (200, 201)
        secret = admin.post(f"/tenants/{tenant}/keys", json={"name": "test"}).json()["secret"]
    return openai.OpenAI(base_url=platform.base_url, api_key=secret, max_retries=0)


def test_create_plain(platform: Platform, client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello", instructions="Be brief.", max_output_tokens=12,
                                       temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and response.output_text
    assert response.usage.output_tokens == 12 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.usage.input_tokens_details.cached_tokens >= 0
    assert response.store is True and response.instructions == "Be brief."
    # Billed as the chat completion it ran as: one usage event under the response's request id.
    [event] = read_usage(platform, "demo", {response.id.removeprefix("resp_")})
    assert event.status == "completed" and event.usage.completion_tokens == 12
    metrics = httpx.get(platform.stack.gateway_url + "/metrics").text
    assert 'inferbus_responses_total{response_status="incomplete",status="200"}' in metrics


def test_rate_limits_apply(platform: Platform) -> None:
    limited = other_tenant(platform, limits={"requests_per_minute": 1})
    limited.responses.create(model=MODEL, input="one", max_output_tokens=3)
    with pytest.raises(openai.RateLimitError) as raised:
        limited.responses.create(model=MODEL, input="two", max_output_tokens=3)
    assert raised.value.body["code"] == "rate_limit_exceeded" and raised.value.response.headers["retry-after"]


def test_streamed_events_match_the_whole_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Tell me about NATS", max_output_tokens=20, temperature=0)
    with client.responses.stream(
        model=MODEL, input="Tell me about NATS", max_output_tokens=20, temperature=0
    ) as stream:
        events = list(stream)
    assert [e.type for e in events if e.type != "response.output_text.delta"] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]  # cut at max_output_tokens, as OpenAI reports it
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == 20 and final.incomplete_details.reason == "max_output_tokens"
    assert len({final.id, events[0].response.id}) == 1
    assert client.responses.retrieve(final.id).output_text == text


def test_function_tool_round_trip_with_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="What's the weather in Paris right now?", tools=[WEATHER],
                                    instructions=LONG_INSTRUCTIONS, max_output_tokens=200)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], instructions=LONG_INSTRUCTIONS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 18}'}],
        max_output_tokens=10)
    assert second.previous_response_id == first.id
    assert second.output_text and not [item for item in second.output if item.type == "function_call"]
    # The follow-up extends the first prompt, so it went to the worker holding that prefix.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 64
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "function_call", "function_call_output"]
    assert items.data[1].call_id == call.call_id


def test_streamed_function_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="What's the weather in Oslo?", tools=[WEATHER],
                                 max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = [item for item in final.output if item.type == "function_call"]
    assert deltas == call.arguments and call.name == "get_weather"
    assert "response.function_call_arguments.done" in [e.type for e in events]


class City(pydantic.BaseModel):
    name: str
    population: int


def test_text_format_json_schema_parsed_by_responses_parse(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input="Name a large city", text_format=City, max_output_tokens=300)
    assert isinstance(parsed.output_parsed, City)
    as_json = client.responses.create(model=MODEL, input="A JSON object please", max_output_tokens=300,
                                      text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(as_json.output_text), dict)


def test_retrieve_and_delete(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="hi", max_output_tokens=5, metadata={"k": "v"})
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text and fetched.metadata == {"k": "v"}
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    not_stored = client.responses.create(model=MODEL, input="hi", max_output_tokens=5, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_stored.id)


def test_another_tenant_gets_404(platform: Platform, client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="secret plans", max_output_tokens=5)
    stranger = other_tenant(platform)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.input_items.list(created.id)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as raised:
        stranger.responses.create(model=MODEL, previous_response_id=created.id, input="and?", max_output_tokens=5)
    assert raised.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(created.id).id == created.id  # still there for its owner


def test_what_is_not_built_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input="news?", tools=[{"type": "web_search"}])
    assert raised.value.body["param"] == "tools[0].type" and "web_search" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input="x", background=True)
    assert raised.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model="no-such-model", input="x")
    assert raised.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as raised:  # the chat path's own checks, in Responses terms
        client.responses.create(model=MODEL, input="x", max_output_tokens=10**9)
    assert raised.value.body["param"] == "max_output_tokens"


def test_a_conversation_over_the_stored_size_limit_is_a_400(client: openai.OpenAI) -> None:
    long = "word " * 5000
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input=long, max_output_tokens=3)
    assert raised.value.body["code"] == "conversation_too_large" and raised.value.body["param"] == "input"
    assert client.responses.create(model=MODEL, input=long, max_output_tokens=3, store=False).output_text


def test_conversation_survives_a_gateway_restart(platform: Platform, client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Remember the number 7", max_output_tokens=6)
    gateway = platform.stack.get("gateway")
    gateway.signal(signal.SIGKILL)
    assert gateway.wait(5)
    gateway.start()
    wait_for(platform.stack.gateway_serving, 30, interval=0.1, what="the gateway back")
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, input="Which number?",
                                     max_output_tokens=6)
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert items[0].content[0].text == "Remember the number 7" and items[1].role == "assistant"


def test_an_agents_sdk_agent_with_a_function_tool(platform: Platform) -> None:
    """The agent asks the model, the model calls the tool, the SDK runs it; its result is the answer
    (`stop_on_first_tool`: the suite's simulated engines answer until max_output_tokens, and the
    Agents SDK takes an incomplete response for an error; test_sim_answers.py runs agents to the end
    with answers that end). Plain and streamed runs."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"18 C and clear in {city}"

    async def run() -> tuple[str, str, list[str]]:
        client = platform.async_client()
        set_default_openai_client(client, use_for_tracing=False)
        set_tracing_disabled(True)
        agent = Agent(name="forecaster", instructions="Answer weather questions with the tool.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(max_tokens=200), tool_use_behavior="stop_on_first_tool")
        plain = await Runner.run(agent, "What's the weather in Paris?", max_turns=3)
        streamed = Runner.run_streamed(agent, "What's the weather in Oslo?", max_turns=3)
        kinds = [event.type async for event in streamed.stream_events()]
        return str(plain.final_output), str(streamed.final_output), kinds

    plain, streamed, kinds = asyncio.run(run())
    assert len(called) == 2 and all(called)
    assert plain == f"18 C and clear in {called[0]}" and streamed == f"18 C and clear in {called[1]}"
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
