"""NVIDIA Dynamo 1.6.1's frontend and mocker workers as a front end of the routing benchmark.

`python -m dynamo.frontend --router-mode kv|round-robin` in front of one `python -m dynamo.mocker`
process per engine, all from `.venv-dynamo` (`bench/dynamo_env.py`), on loopback with file
discovery, the TCP request plane and the ZMQ event plane (no etcd, no NATS).

The mockers get the engine our simulated engines run: the profile table of the same GPU and TP
(`services/sim_engine/profile_table`, `--planner-profile-data`), the same KV pool in the same
block size, SGLang scheduling with the same chunked-prefill budget and batch limit, and the time
scale of the benchmark as `--speedup-ratio`.

The frontend tokenizes prompts with a model directory written here: a word-level tokenizer whose
vocabulary is the trace's prompt words (`tools.capacity.traces`: one word per token), so a prompt is
exactly the trace's `input_length` tokens, as it is for our engines. The mocker's output ids are
drawn from the same vocabulary.

The frontend logs at info level one line per completed request (its id, `decode_worker_id`,
input and output tokens, its own `ttft_ms`) and, in KV mode, one per routing decision with the
blocks its index found cached on the chosen worker (`overlap_blocks`): `request_records` reads
them, for the tokens per worker (load imbalance), the hits (the mocker puts none in the usage)
and a TTFT to check the client against.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import dynamo_env
from inferbus.local.ports import free_port
from inferbus.local.process import Process
from tools.capacity import traces

ROUTER_MODES = {"dynamo_kv": "kv", "dynamo_round_robin": "round-robin"}
SPECIAL = ["<unk>", "<s>", "</s>"]


def write_model_dir(path: Path, context_tokens: int) -> Path:
    """A model directory for Dynamo's frontend: word-level tokenizer over the trace's prompt words."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for word in traces._WORDS:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Each word carries its leading space, so the text splits before every space.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[^ ]+"), behavior="isolated")
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": context_tokens, "add_bos_token": False,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(vocab),
        "max_position_embeddings": context_tokens, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_size": 8192, "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
    }))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def max_running(engine_info: dict[str, Any]) -> int:
    """The engine's effective batch limit (SGLang's /server_info has the flag, null unless given)."""
    return int(engine_info.get("max_running_requests")
               or engine_info["internal_states"][0]["effective_max_running_requests_per_dp"])


def environment(state: Path) -> dict[str, str]:
    """Dynamo on loopback, with file discovery and no etcd or NATS."""
    return dict(
        os.environ, DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(state / "discovery"),
        DYN_REQUEST_PLANE="tcp", DYN_EVENT_PLANE="zmq", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        DYN_TCP_RPC_HOST="127.0.0.1", DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
        DYN_SYSTEM_HOST="127.0.0.1", PYTHONUNBUFFERED="1",
        # Info level: the frontend logs the worker it chose for every request.
        DYN_LOG="info",
    )


class DynamoFrontend:
    """Dynamo's frontend with `router_mode` over one mocker process per engine of ours."""

    endpoint = "completions"

    def __init__(self, policy: str, engines: int, model: str, engine_info: dict[str, Any], table_path: Path,
                 model_dir: Path, time_scale: float, state: Path) -> None:
        self.name = policy
        self.model = model
        self.engines = engines
        self.state = state / policy
        python = str(dynamo_env.ensure())
        env = environment(self.state)
        block = self.block_size = int(engine_info["page_size"])
        self.summary: dict[str, Any] = {}
        self.log = self.state / "logs" / "frontend.log"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1/completions"
        self.headers = {"content-type": "application/json"}
        self.mockers: list[Process] = []
        for i in range(1, engines + 1):
            argv = [python, "-m", "dynamo.mocker", "--model-path", str(model_dir), "--model-name", model,
                    "--engine-type", "sglang", "--block-size", str(block),
                    "--num-gpu-blocks-override", str(int(engine_info["max_total_num_tokens"]) // block),
                    "--max-num-seqs", str(max_running(engine_info)),
                    "--max-num-batched-tokens", str(engine_info["chunked_prefill_size"]),
                    "--sglang-chunked-prefill-size", str(engine_info["chunked_prefill_size"]),
                    "--enable-prefix-caching", "--enable-chunked-prefill",
                    "--planner-profile-data", str(table_path), "--speedup-ratio", str(1.0 / time_scale)]
            port = free_port()
            self.mockers.append(Process(f"mocker-{i}", argv, dict(env, DYN_SYSTEM_PORT=str(port)),
                                        self.state / "logs" / f"mocker-{i}.log", lambda: True,
                                        f"http://127.0.0.1:{port}"))
        argv = [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(self.port),
                "--router-mode", ROUTER_MODES[policy], "--kv-cache-block-size", str(block)]
        self.frontend = Process("dynamo-frontend", argv, env, self.log, self._ready, self.base)

    def _ready(self) -> bool:
        """Serving the model with every mocker registered (their workers in the frontend's metrics)."""
        try:
            with urllib.request.urlopen(self.base + "/v1/models", timeout=1) as response:
                if self.model not in {m.get("id") for m in json.load(response).get("data", [])}:
                    return False
        except Exception:
            return False
        return len(self.discovered_workers()) >= self.engines

    def discovered_workers(self) -> set[str]:
        """The mockers' `generate` endpoints registered in file discovery (one file per instance)."""
        return {path.name for path in (self.state / "discovery").rglob("dynamo%2Fbackend%2Fgenerate%2F*")
                if path.is_file()}

    def start(self) -> None:
        for p in self.mockers:
            p.start()
        self.frontend.start()
        deadline = time.monotonic() + 120
        while not self.frontend.ready():
            dead = [p for p in [*self.mockers, self.frontend] if not p.alive()]
            if dead or time.monotonic() > deadline:
                tails = "\n".join(f"{p.name}:\n{p.tail()}" for p in (dead or [self.frontend]))
                self.stop()
                raise RuntimeError(f"Dynamo did not start:\n{tails}")
            time.sleep(0.3)
        time.sleep(1.0)  # let the KV router connect to every mocker's event stream

    def stop(self) -> None:
        for p in [self.frontend, *self.mockers]:
            p.signal(signal.SIGTERM)
        for p in [self.frontend, *self.mockers]:
            if not p.wait(5):
                p.signal(signal.SIGKILL)
                p.wait(5)

    def pids(self) -> dict[str, int]:
        return {"dynamo-frontend": self.frontend.pid, **{p.name: p.pid for p in self.mockers}}

    def counters(self) -> dict[str, float]:
        return {}

    def queue_wait(self) -> dict[str, float]:
        return {}

    def metrics(self) -> bytes:
        with urllib.request.urlopen(self.base + "/metrics", timeout=5) as response:
            return response.read()

    def records(self) -> dict[str, dict[str, Any]]:
        return request_records(self.log)



_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FIELD = re.compile(r'(\w+)="?([^"\s]*)"?')


def request_records(log: Path) -> dict[str, dict[str, Any]]:
    """Per request id, from the frontend's log: the worker (`decode_worker_id`), tokens, its own
    TTFT (`ttft_ms`), and, in KV mode, the blocks its router found cached there (`overlap_blocks`)."""
    records: dict[str, dict[str, Any]] = {}
    if not log.exists():
        return records
    for line in _ANSI.sub("", log.read_text(errors="replace")).splitlines():
        if "decode_worker_id=" in line and "request completed" in line:
            fields = dict(_FIELD.findall(line))
            # "request completed request_id=<the request's> … request_id=<the HTTP span's>"
            match = re.search(r'request completed request_id="?([0-9a-f-]{36})', line)
            if match is None:
                continue
            record = records.setdefault(match.group(1), {})
            record.update(worker=fields["decode_worker_id"], input_tokens=int(fields["input_tokens"]),
                          output_tokens=int(fields["output_tokens"]), ttft_ms=float(fields.get("ttft_ms") or "nan"))
        elif "overlap_blocks=" in line and "route request completed" in line:
            fields = dict(_FIELD.findall(line))
            # "… request_id=<the HTTP span's> … request_id=<the request's> … overlap_blocks=n"
            ids = re.findall(r'request_id="?([0-9a-f-]{36})', line)
            if ids:
                records.setdefault(ids[-1], {})["overlap_blocks"] = int(fields["overlap_blocks"])
    return records


def client_check(requests: int = 30) -> dict[str, dict[str, float]]:
    """Median TTFT of `requests` sequential short completions as an aiohttp client sees it, with
    keep-alive and with a new connection per request, next to the frontend's own per-request TTFT
    (2 mockers at speedup 100, Dynamo KV routing). Run by `python -m bench.dynamo_live`."""
    import asyncio
    import statistics
    import tempfile

    import aiohttp

    from inferbus.timing import roofline
    from services.sim_engine.profile_table import build_table, save_npz

    async def ttfts(frontend: DynamoFrontend, force_close: bool, offset: int) -> list[float]:
        out = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=force_close)) as session:
            for i in range(requests):
                prompt = traces.mooncake_prompt(traces.TraceRequest(0.0, 300, 4, (offset + i,)))
                body = json.dumps({"model": frontend.model, "prompt": prompt, "max_tokens": 4, "stream": True})
                start, first = time.perf_counter(), None
                async with session.post(frontend.url, data=body.encode(), headers=frontend.headers) as response:
                    async for line in response.content:
                        if first is None and b'"text":"' in line and b'"text":""' not in line:
                            first = time.perf_counter() - start
                out.append((first or float("nan")) * 1000)
        return out

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="dynamo-client-check-") as tmp:
        state = Path(tmp)
        save_npz(build_table(roofline("H100", 2)), state / "profile.npz")
        info = {"page_size": 64, "max_total_num_tokens": 418_688, "max_running_requests": 256,
                "chunked_prefill_size": 512}
        frontend = DynamoFrontend("dynamo_kv", 2, "check", info, state / "profile.npz",
                                  write_model_dir(state / "model", 131_072), 0.01, state)
        try:
            frontend.start()
            asyncio.run(ttfts(frontend, True, 0))  # warm-up, not counted
            for n, (name, force_close) in enumerate((("keep-alive", False), ("new connection", True))):
                client = asyncio.run(ttfts(frontend, force_close, 1_000 * (n + 1)))
                own = [r["ttft_ms"] for r in list(frontend.records().values())[-requests:]]
                results[name] = {
                    "client_ttft_ms": statistics.median(client),
                    "frontend_ttft_ms": statistics.median(own),
                }
        finally:
            frontend.stop()
    return results


if __name__ == "__main__":
    for connection, medians in client_check().items():
        print(f"{connection:>15}: client TTFT median {medians['client_ttft_ms']:.1f} ms, "
              f"Dynamo frontend's own {medians['frontend_ttft_ms']:.1f} ms")
