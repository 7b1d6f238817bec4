"""The simulated engine answers like a model at the protocol level: free text ends with EOS at
lengths drawn from a realistic distribution (`ignore_eos` and `--answer-length-median 0` keep
answers running to max_tokens), on the engine and through the platform with real clients."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from services.sim_engine.cli import sim_engine_command
from services.sim_engine.config import ANSWER_LENGTH_SIGMA, DEFAULT_ANSWER_LENGTH_MEDIAN, EngineConfig
from services.sim_engine.output import EOS_TOKEN_ID
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine

from .conftest import MODEL, Platform, running_platform


def prompt(seed: int, length: int = 32) -> list[int]:
    return [(seed * 7919 + i * 31) % 100_000 for i in range(length)]


def run(engine: Engine, requests: list[Request]) -> dict[str, tuple[int, dict]]:
    """Output length and finish reason of each request, run to completion."""
    for request in requests:
        engine.add(request)
    done: dict[str, tuple[int, dict]] = {}
    while engine.has_work:
        for update in engine.step().updates:
            if update.finish_reason is not None:
                done[update.request.rid] = (update.num_output_tokens, update.finish_reason)
    return done


@pytest.mark.slow
def test_free_text_ends_with_eos_at_lengths_of_the_configured_distribution() -> None:
    engine = Engine(EngineConfig(fixed_step_ms=1.0, max_running_requests=400))
    greedy = [Request(f"r{i}", prompt(i), SamplingParams(max_new_tokens=8192, temperature=0.0)) for i in range(400)]
    done = run(engine, greedy)
    lengths = sorted(n for n, _ in done.values())
    assert all(reason == {"type": "stop", "matched": EOS_TOKEN_ID} for _, reason in done.values())
    median = DEFAULT_ANSWER_LENGTH_MEDIAN
    assert 0.85 * median < statistics.median(lengths) < 1.15 * median
    # One in ten under median·e^(−1.28σ) (57 tokens) and one in ten over median·e^(1.28σ) (570).
    low, high = median * math.exp(-1.2816 * ANSWER_LENGTH_SIGMA), median * math.exp(1.2816 * ANSWER_LENGTH_SIGMA)
    assert 0.06 < sum(n < low for n in lengths) / len(lengths) < 0.14
    assert 0.06 < sum(n > high for n in lengths) / len(lengths) < 0.14
    # Seeded: the same greedy prompt ends at the same length; a sampled one by its seed.
    again = run(engine, [Request("again", prompt(7), SamplingParams(max_new_tokens=8192, temperature=0.0))])
    assert again["again"][0] == done["r7"][0]
    seeded = [Request(f"s{i}", prompt(7), SamplingParams(max_new_tokens=8192, sampling_seed=i % 2)) for i in range(4)]
    by_seed = run(engine, seeded)
    assert by_seed["s0"][0] == by_seed["s2"][0] and by_seed["s1"][0] == by_seed["s3"][0]


def test_ignore_eos_min_tokens_and_a_zero_median_keep_answers_running() -> None:
    engine = Engine(EngineConfig(fixed_step_ms=1.0))
    short_one = next(i for i in range(200) if run(Engine(EngineConfig(fixed_step_ms=1.0)), [
        Request("x", prompt(i), SamplingParams(max_new_tokens=8192, temperature=0.0))])["x"][0] < 100)
    done = run(engine, [
        Request("eos", prompt(short_one), SamplingParams(max_new_tokens=300, temperature=0.0)),
        Request("ignore", prompt(short_one), SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True)),
        Request("min", prompt(short_one), SamplingParams(max_new_tokens=300, temperature=0.0, min_new_tokens=150)),
    ])
    assert done["eos"][0] < 100 and done["eos"][1]["type"] == "stop"
    assert done["ignore"] == (300, {"type": "length", "length": 300})
    assert done["min"][0] == 150 and done["min"][1] == {"type": "stop", "matched": EOS_TOKEN_ID}
    never = Engine(EngineConfig(fixed_step_ms=1.0, answer_length_median=0))
    assert run(never, [Request("n", prompt(short_one), SamplingParams(max_new_tokens=300, temperature=0.0))])["n"] == \
        (300, {"type": "length", "length": 300})


def test_the_option_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    import services.sim_engine.app as app

    seen: list[EngineConfig] = []
    monkeypatch.setattr(app, "create_app", lambda config, **_: seen.append(config))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    variable = "INFERBUS_SIM_ANSWER_LENGTH_MEDIAN"
    for args, env in (
        ([], {variable: None}),
        ([], {variable: "0"}),
        (["--answer-length-median", "40"], {variable: "0"}),
    ):
        result = CliRunner().invoke(sim_engine_command, args, env=env)
        assert result.exit_code == 0, result.output
    assert [config.answer_length_median for config in seen] == [DEFAULT_ANSWER_LENGTH_MEDIAN, 0, 40]


# ---- through the platform, with the clients that failed on answers that never end -------------


@pytest.fixture(scope="module")
def ending_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("answers"), workers=1, time_scale=0.0,
                          engine_args=["--answer-length-median", "24"]) as running:
        yield running


@pytest.mark.e2e
def test_answers_end_by_themselves_through_the_platform(ending_platform: Platform) -> None:
    client = ending_platform.client()
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                            max_tokens=2000, temperature=0)
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens < 2000
    fixed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                           max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
    assert fixed.choices[0].finish_reason == "length" and fixed.usage.completion_tokens == 300
    # The Responses API's streamed final response is complete, not incomplete at max_output_tokens.
    with client.responses.stream(model=MODEL, input="Tell me a story.", max_output_tokens=2000) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text


@pytest.mark.e2e
def test_json_mode_follows_the_schema_in_the_prompt(ending_platform: Platform) -> None:
    schema = {"type": "object", "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
              "required": ["setup", "punchline"]}
    client = ending_platform.client()
    response = client.chat.completions.create(
        model=MODEL,
        max_tokens=400,
        response_format={"type": "json_object"},
        messages=[
            {"role": "system", "content": "Answer with JSON matching this schema: " + json.dumps(schema)},
            {"role": "user", "content": "Tell me a joke."},
        ],
    )
    value = json.loads(response.choices[0].message.content or "")
    assert set(value) == {"setup", "punchline"} and response.choices[0].finish_reason == "stop"


@pytest.mark.e2e
def test_an_agents_sdk_agent_runs_to_completion_on_both_paths(ending_platform: Platform) -> None:
    """The agent asks the model, the model calls the tool, the SDK runs it and asks again; the model
    answers in text that ends, so the run completes (on Responses and on Chat Completions)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"18 C and clear in {city}"

    async def run_both() -> list[str]:
        client = ending_platform.async_client()
        set_tracing_disabled(True)
        outputs = []
        for model in (OpenAIResponsesModel(model=MODEL, openai_client=client),
                      OpenAIChatCompletionsModel(model=MODEL, openai_client=client)):
            agent = Agent(
                name="forecaster",
                instructions="Answer weather questions with the tool.",
                tools=[get_weather],
                model=model,
                model_settings=ModelSettings(max_tokens=2000),
            )
            result = await Runner.run(agent, "What's the weather in Paris?", max_turns=4)
            outputs.append(str(result.final_output))
        return outputs

    outputs = asyncio.run(run_both())
    assert len(called) == 2 and all(outputs)
