"""The closed-loop driver: `concurrency` clients against one engine in virtual time, the
throughput and latencies it measures (the calibration and the capacity tools' per-engine numbers)."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from inferbus.timing import StepTimeModel
from inferbus.tokens.blocks import VOCAB_SIZE

from .config import EngineConfig
from .request import Request
from .sampling import SamplingParams
from .scheduler import Engine


@dataclass(frozen=True, slots=True)
class ClosedLoopStats:
    concurrency: int
    completed: int  # requests measured (after warm-up)
    duration_s: float  # virtual seconds of the measurement window
    output_tokens_per_s: float
    mean_ttft_s: float
    mean_itl_s: float  # per request (e2e − TTFT) / (output − 1), then averaged, as genai-perf does
    mean_e2e_s: float
    steps: int
    preemptions: int


def simulate_closed_loop(
    config: EngineConfig,
    concurrency: int,
    input_len: int,
    output_len: int,
    n_requests: int | None = None,
    duration_s: float | None = None,
    *,
    warmup_requests: int | None = None,
    step_model: StepTimeModel | None = None,
    seed: int = 0,
) -> ClosedLoopStats:
    """`concurrency` clients each send a new request as soon as the last finishes, in virtual time.

    Prompts are `input_len` random tokens, distinct per request from the first block on, so the
    prefix cache never helps; output is exactly `output_len` tokens. The first `warmup_requests`
    completions (default: one per client) are left out, as is the time before the last of them.
    Stops after `n_requests` measured completions or `duration_s` virtual seconds.
    """
    if n_requests is None and duration_s is None:
        raise ValueError("give n_requests or duration_s")
    warmup = concurrency if warmup_requests is None else warmup_requests
    engine = Engine(config, step_model)
    rng = random.Random(seed)
    body = [rng.randrange(VOCAB_SIZE) for _ in range(input_len)]
    sampling = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        prompt = list(body)
        prompt[0] = submitted % VOCAB_SIZE
        if input_len > 1:
            prompt[1] = submitted // VOCAB_SIZE
        engine.add(Request(rid=f"closed-loop-{submitted}", input_ids=prompt, sampling=sampling))
        submitted += 1

    for _ in range(concurrency):
        submit()
    done = 0
    window_start: float | None = None if warmup else 0.0
    tokens_at_start = 0
    measured: list[Request] = []
    steps = 0
    while True:
        result = engine.step()
        steps += 1
        if result.idle:
            raise RuntimeError("closed-loop simulation stalled: nothing can run")
        finished = [u.request for u in result.updates if u.finish_reason is not None]
        for request in finished:
            done += 1
            if done > warmup:
                measured.append(request)
            elif done == warmup:
                window_start = engine.now
                tokens_at_start = engine.generation_tokens_total
        if n_requests is not None and len(measured) >= n_requests:
            break
        if duration_s is not None and engine.now >= duration_s:
            break
        for _ in finished:
            submit()

    start = window_start if window_start is not None else 0.0
    window = engine.now - start
    ttfts = [r.first_token_time - r.arrival_time for r in measured if r.first_token_time is not None]
    itls = [
        (r.finish_time - r.first_token_time) / (len(r.output_ids) - 1)
        for r in measured
        if r.first_token_time is not None and r.finish_time is not None and len(r.output_ids) > 1
    ]
    e2es = [r.finish_time - r.arrival_time for r in measured if r.finish_time is not None]
    return ClosedLoopStats(
        concurrency=concurrency,
        completed=len(measured),
        duration_s=window,
        output_tokens_per_s=(engine.generation_tokens_total - tokens_at_start) / window if window > 0 else 0.0,
        mean_ttft_s=_mean(ttfts),
        mean_itl_s=_mean(itls),
        mean_e2e_s=_mean(e2es),
        steps=steps,
        preemptions=engine.preemptions_total,
    )


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
