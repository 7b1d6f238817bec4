"""Workload mixes: built-in, YAML specs and traces, and the moments the planner uses."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from tools.capacity import mix, traces


def shared_trace(name: str) -> Path:
    """One of the project's shared traces (`traces/`, or `INFERBUS_TRACES_DIR`)."""
    try:
        return traces.find(name)
    except FileNotFoundError as missing:
        pytest.skip(str(missing))


def test_worked_example_has_perf_models_means() -> None:
    stats = mix.load("worked-example").stats()
    assert stats.input_tokens == pytest.approx(2060)
    assert stats.output_tokens == pytest.approx(330)
    # 0.6·600·0.6 + 0.3·3000·0.5 + 0.1·8000·0.1 cached tokens.
    assert stats.cached_tokens == pytest.approx(216 + 450 + 80)
    assert stats.uncached_tokens == pytest.approx(2060 - 746)
    # E[u²] = 0.6·240² + 0.3·1500² + 0.1·7200².
    assert stats.uncached_sq == pytest.approx(0.6 * 240**2 + 0.3 * 1500**2 + 0.1 * 7200**2)
    # A decoding sequence of the short class sits at 600 + 125 tokens on average, weighted by its 250 steps.
    expected = (0.6 * 250 * 725 + 0.3 * 400 * 3200 + 0.1 * 600 * 8300) / 330
    assert stats.decode_ctx_tokens == pytest.approx(expected)


@pytest.mark.slow
def test_sampling_follows_the_weights_and_keeps_one_token_uncached() -> None:
    worked = mix.load("worked-example")
    draws = worked.sample_many(20_000, seed=1)
    share = sum(d.kind == "short chat" for d in draws) / len(draws)
    assert share == pytest.approx(0.6, abs=0.02)
    assert all(0 <= d.cached_tokens < d.input_tokens for d in draws)
    assert worked.sample_many(5, seed=3) == worked.sample_many(5, seed=3)


@pytest.mark.slow
def test_yaml_spec_distributions(tmp_path: Path) -> None:
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump({"name": "chat", "classes": [
        {"name": "a", "weight": 3, "input_tokens": {"dist": "lognormal", "median": 200, "p90": 450, "max": 2000},
         "output_tokens": {"dist": "uniform", "min": 10, "max": 20}, "cached_fraction": 0.5},
        {"name": "b", "input_tokens": {"dist": "choice", "values": [100, 200], "weights": [1, 3]},
         "output_tokens": {"dist": "normal", "mean": 50, "std": 10}},
    ]}))
    loaded = mix.load(path)
    assert loaded.name == "chat" and loaded.shares == [0.75, 0.25]
    rng = random.Random(0)
    a = [loaded.classes[0].sample(rng) for _ in range(5000)]
    assert all(10 <= r.output_tokens <= 20 and r.input_tokens <= 2000 for r in a)
    median = sorted(r.input_tokens for r in a)[len(a) // 2]
    assert median == pytest.approx(200, rel=0.05)
    b = [loaded.classes[1].sample(rng) for _ in range(4000)]
    assert sum(r.input_tokens == 200 for r in b) / len(b) == pytest.approx(0.75, abs=0.03)
    described = loaded.describe()
    assert described["classes"][1]["input_tokens"] == {
        "dist": "choice",
        "values": [100, 200],
        "weights": [1.0, 3.0],
        "min": 1,
        "max": 1_000_000,
    }


@pytest.mark.parametrize(("spec", "message"), [
    ({"classes": []}, "non-empty list"),
    ({"classes": [{"input_tokens": 10}]}, "needs input_tokens and output_tokens"),
    ({"classes": [{"input_tokens": {"dist": "zipf"}, "output_tokens": 1}]}, "dist must be one of"),
    ({"classes": [{"input_tokens": {"dist": "normal", "mean": 5}, "output_tokens": 1}]}, "needs std"),
    ({"classes": [{"input_tokens": 10, "output_tokens": 1, "cached_fraction": 1.0}]}, "cached_fraction"),
    ({"classes": [{"input_tokens": 0, "output_tokens": 1}]}, "at least 1"),
    ({"classes": [{"input_tokens": 10, "output_tokens": 1, "colour": "red"}]}, "unknown field(s) colour"),
    ({"clases": []}, "unknown field(s) clases"),
])
def test_bad_specs_name_the_field(spec: dict, message: str) -> None:
    with pytest.raises(mix.MixError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mix.from_spec(spec, "bad.yaml")


def test_unknown_name_and_format(tmp_path: Path) -> None:
    with pytest.raises(mix.MixError, match="not a built-in"):
        mix.load("no-such-mix")
    odd = tmp_path / "mix.toml"
    odd.write_text("")
    with pytest.raises(mix.MixError, match="unknown mix format"):
        mix.load(odd)


def test_mooncake_trace_cached_tokens_are_the_infinite_cache_hits() -> None:
    trace = mix.load(shared_trace("mooncake_synthetic.jsonl"))
    stats = trace.stats()
    # traces/README.md: 65.1% of tokens hit an infinite cache replayed in time order.
    assert stats.cached_tokens / stats.input_tokens == pytest.approx(0.651, abs=0.01)
    assert stats.input_tokens == pytest.approx(15_326, rel=0.01)


@pytest.mark.slow
def test_azure_trace_takes_a_cached_fraction() -> None:
    plain = mix.load(shared_trace("azure_2023_conv.csv"))
    assert plain.mean_cached_tokens == 0
    assert plain.mean_input_tokens == pytest.approx(1155, rel=0.01)
    assert plain.mean_output_tokens == pytest.approx(211, rel=0.01)
    cached = mix.load(shared_trace("azure_2023_conv.csv"), cached_fraction=0.3)
    assert cached.mean_cached_tokens / cached.mean_input_tokens == pytest.approx(0.3, abs=0.01)


def test_an_azure_format_csv_is_read_by_its_columns(tmp_path: Path) -> None:
    trace = tmp_path / "small.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,1000,100\n"
                     "2023-11-16 18:15:47.1805900,3000,300\n")
    loaded = mix.load(trace, cached_fraction=0.5)
    assert (loaded.mean_input_tokens, loaded.mean_output_tokens) == (2000, 200)
    assert loaded.mean_cached_tokens == 1000
    assert [r.arrival_s for r in traces.load(trace)] == [0.0, 0.5]


def test_a_trace_is_found_by_name_on_the_search_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    monkeypatch.setenv("INFERBUS_TRACES_DIR", str(tmp_path))
    assert traces.find("mine.csv") == tmp_path / "mine.csv"
    with pytest.raises(FileNotFoundError, match="INFERBUS_TRACES_DIR"):
        traces.find("nobody.csv")
