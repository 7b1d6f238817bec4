"""An interactive prompt preempts a batch prompt on a full prefill worker, live
(`inferbus up --prefill 1 --decode 2`, workers capped at two requests each): two decode workers
each hold a batch line whose long prompt fills one of the prefill worker's two slots; an
interactive request from the openai SDK then takes the slot of the batch half sent to its engine first (the
one the prefill engine computes), which its decode worker hands back to the batch queue; the
interactive answer does not wait for a batch prompt, and the batch still completes, every line
once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from .conftest import MODEL, running_platform
from .service_logs import log_events

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PREFILL = 1  # engine-1 / worker-1 is the prefill one


def test_an_interactive_prompt_preempts_a_batch_prompt_on_a_full_prefill_worker(tmp_path: Path) -> None:
    env = {"INFERBUS_WORKER_MAX_RUNNING": "2", "INFERBUS_WORKER_BATCH_MAX_PREFILLING": "2",
           "INFERBUS_BATCH_RESERVE_SLOTS": "1"}  # the batch feed may fill all but one slot per worker
    with running_platform(tmp_path, prefill=1, decode=2, time_scale=1.0, extra_env=env) as platform:
        client = platform.client(timeout=60)
        started = time.monotonic()
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "quick question"}], max_tokens=3
        )
        alone_s = time.monotonic() - started
        long_prompt = " ".join(f"word{i}" for i in range(24000))
        engine = platform.engine_url(PREFILL)
        batches = []
        for i in range(2):  # one line per batch, the second once the first reached the prefill engine
            line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "messages": [{"role": "user", "content": f"{i} {long_prompt}"}],
                             "max_tokens": 3}}
            file_id = client.files.create(file=(f"input-{i}.jsonl", json.dumps(line).encode() + b"\n"),
                                          purpose="batch").id
            batches.append(client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                 completion_window="24h"))
            deadline = time.monotonic() + 60
            while True:  # on the prefill engine: after the second, every prefill slot is taken
                loads = httpx.get(engine + "/v1/loads", params={"include": "all"}).json()["loads"]
                if sum(e["num_running_reqs"] + e["num_waiting_reqs"] for e in loads) >= i + 1:
                    break
                assert time.monotonic() < deadline, "the batch prompts never reached the prefill engine"
                time.sleep(0.02)
        started = time.monotonic()
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "quick question"}],
                                               max_tokens=3)
        interactive_s = time.monotonic() - started
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        # Its prompt did not wait for a batch prompt's prefill (about 10 s each here): the batch half
        # preempted is the one the engine was computing, not one waiting behind it (the logs below
        # say which). Alone it took `alone_s`; five seconds leave room for a loaded machine.
        assert interactive_s < 5.0, f"{interactive_s:.1f} s (alone: {alone_s:.1f} s)"
        deadline = time.monotonic() + 120
        for i, batch in enumerate(batches):
            while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired",
                                                                               "cancelled"):
                assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch.request_counts}"
                time.sleep(0.2)
            batches[i] = batch
        logs = tmp_path / "logs"
        preempted = [e for e in log_events(logs / f"worker-{PREFILL}.log", "prefill_half_aborted")
                     if str(e.get("why", "")).startswith("preempted for interactive")]
        handed_back = [e for n in (2, 3) for e in log_events(logs / f"worker-{n}.log", "batch_prefill_preempted")]
        requeued = [e for n in (2, 3) for e in log_events(logs / f"worker-{n}.log", "batch_requeued")
                    if e.get("reason") == "preempted"]
        assert len(preempted) == 1, preempted
        assert [e["request_id"] for e in handed_back] == [preempted[0]["request_id"]]
        assert [e["request_id"] for e in requeued] == [preempted[0]["request_id"]]
        outputs = []
        for batch in batches:
            assert batch.status == "completed" and batch.request_counts is not None
            assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 0)
            outputs += [
                json.loads(line)
                for line in client.files.content(batch.output_file_id or "").content.splitlines()
                if line.strip()
            ]
        assert sorted(o["custom_id"] for o in outputs) == ["line-0", "line-1"]
        assert all(o["response"]["body"]["usage"]["completion_tokens"] == 3 for o in outputs)
        # The line preempted is the first (its prompt reached the engine first).
        assert preempted[0]["request_id"].startswith(batches[0].id)
        print(
            f"interactive request alone: {alone_s * 1e3:.0f} ms; beside two batch prompts: {interactive_s * 1e3:.0f} ms"
        )
