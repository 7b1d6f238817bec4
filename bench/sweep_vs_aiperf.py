"""`inferbus sweep` against NVIDIA aiperf on the same endpoint and load.

    python -m bench.sweep_vs_aiperf [--concurrency 1,4,16] [--requests 10,48,128] [--rates 1.13,2.37]
                                    [--rate-requests 30,60] [--input 1000] [--output 200]
                                    [--endpoint chat] [--time-scale 1]

What runs:
1. aiperf (PyPI `aiperf`, pinned below) is installed into `.venv-aiperf` on first use: it pins
   dependencies of its own (transformers, pydantic, ...) that must not leak into the project venv.
2. A tokenizer for aiperf: aiperf needs a Hugging Face tokenizer to synthesise prompts of N
   tokens, and there is no hub here. We build one (`tokenizers` WordLevel model) whose
   pre-tokenizer is `inferbus.tokens.blocks`' regex, with a vocabulary covering aiperf's prompt corpus,
   the simulated engine's output words and the chat template, a concatenating decoder and the
   gateway's Llama-3 chat template. aiperf's 1,000-token prompt is then 1,000 tokens to the
   simulated engine (checked in the results: the server-reported ISL).
3. One simulated engine with OpenAI endpoints (`inferbus sim-engine`, which serves SGLang's OpenAI endpoints, H100 TP2,
   latency preset, `--time-scale 1`: GPU-realistic milliseconds), fixed lengths (input 1,000,
   output 200, nothing cached).
4. For each concurrency (closed loop), then each rate (open loop, constant arrivals), one after
   the other (never both at once): `POST /flush_cache`, aiperf (`--concurrency C` or
   `--request-rate R --arrival-pattern constant`, `--request-count N`, streaming,
   `--use-server-token-count`, `--extra-inputs ignore_eos:true`, closed loop with a warm-up of C
   requests (`--warmup-request-count C`: connections open, then a clean start), `--apply-chat-template` so its
   ISL includes the template as ours does, as many distinct prompts as requests and warm-up
   requests together, so that none repeats and hits the prefix cache);
   `POST /flush_cache`; `inferbus sweep` (`--concurrency C --warmup C` or `--rate R --arrival
   constant`, `--requests N`, the same lengths).
5. Closed loop only, once more: `inferbus sweep --think-time-ms T` with T = aiperf's measured
   re-issue delay (a completion → its worker's next send), so that both offer the same load (the
   note in the results says why it matters for TTFT).
6. Side by side: TTFT, TPOT (aiperf: "inter_token_latency"), ITL (aiperf: "inter_chunk_latency"),
   end-to-end ("request_latency") p50/p90, request and output-token throughput and goodput, with
   the difference and PASS when within 5% (closed loop: judged on the run of step 5).

Results: bench/results/sweep_vs_aiperf.{json,md}. Takes about 12 minutes on 2 cores with defaults
(plus aiperf's install on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_results

ROOT = Path(__file__).resolve().parents[1]
AIPERF_VENV = ROOT / ".venv-aiperf"
AIPERF_VERSION = "0.13.0"
TOLERANCE = 0.05
MODEL = "meta-llama/Llama-3.3-70B-Instruct"

# aiperf metric tag → our step key; "stat" picks the same statistic from both.
COMPARED = [
    ("TTFT mean (ms)", "time_to_first_token", "avg", ("ttft_s", "mean")),
    ("TTFT p50 (ms)", "time_to_first_token", "p50", ("ttft_s", "p50")),
    ("TTFT p90 (ms)", "time_to_first_token", "p90", ("ttft_s", "p90")),
    ("TPOT p50 (ms) [aiperf ITL]", "inter_token_latency", "p50", ("tpot_s", "p50")),
    ("TPOT p90 (ms) [aiperf ITL]", "inter_token_latency", "p90", ("tpot_s", "p90")),
    ("ITL p50 (ms) [aiperf ICL]", "inter_chunk_latency", "p50", ("itl_s", "p50")),
    ("E2E p50 (ms)", "request_latency", "p50", ("e2e_s", "p50")),
    ("E2E p90 (ms)", "request_latency", "p90", ("e2e_s", "p90")),
    ("request throughput (req/s)", "request_throughput", "avg", ("request_rps",)),
    ("output throughput (tok/s)", "output_token_throughput", "avg", ("output_tok_s",)),
    ("goodput (req/s)", "goodput", "avg", ("goodput_rps",)),
]


def ensure_aiperf() -> Path:
    """`.venv-aiperf/bin/aiperf`, installing aiperf there on first use."""
    binary = AIPERF_VENV / "bin" / "aiperf"
    if not binary.exists():
        print(f"installing aiperf=={AIPERF_VERSION} into {AIPERF_VENV} (first use) …", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        f"aiperf=={AIPERF_VERSION}"], check=True)
    return binary


_BUILD_TOKENIZER = r"""
import json, sys
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
spec = json.load(open(sys.argv[1]))
# The unknown token must be one token to the engine too (aiperf may put it in a prompt): "[UNK]"
# would be three there ("[", "UNK", "]").
UNK = "\u00a4"
vocab = {UNK: 0}
for piece in spec["pieces"]:
    vocab.setdefault(piece, len(vocab))
tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(spec["pattern"]), behavior="isolated")
tokenizer.decoder = decoders.Fuse()
tokenizer.save(sys.argv[2] + "/tokenizer.json")
config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": UNK, "model_max_length": 1000000,
          "clean_up_tokenization_spaces": False, "chat_template": spec["chat_template"]}
json.dump(config, open(sys.argv[2] + "/tokenizer_config.json", "w"))
json.dump({}, open(sys.argv[2] + "/special_tokens_map.json", "w"))
"""

# The stand-in rendering (inferbus.tokens.blocks.standin_render_chat) as a Jinja chat template.
CHAT_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def build_tokenizer(directory: Path) -> Path:
    """A Hugging Face tokenizer that splits text exactly as `inferbus.tokens.blocks` does."""
    from inferbus.tokens import blocks as tokens
    from inferbus.tokens.blocks import standin_render_chat as render_chat
    from services.sim_engine.output import OUTPUT_PIECES
    from tools.capacity.sweep.prompts import WORDS

    corpus = next((AIPERF_VENV / "lib").glob("python*/site-packages/aiperf/dataset/generator/assets/shakespeare.txt"))
    pattern = tokens._PIECE.pattern
    pieces = set(re.findall(pattern, corpus.read_text()))
    pieces.update(WORDS, OUTPUT_PIECES, re.findall(pattern, render_chat([{"role": "user", "content": " x"}])))
    # Every printable ASCII character with and without a leading space, and short whitespace runs.
    pieces.update(c for ch in map(chr, range(33, 127)) for c in (ch, " " + ch))
    pieces.update(a + b + c for a in ("", " ", "\n") for b in ("", " ", "\n") for c in (" ", "\n", "\t"))
    spec = {"pattern": pattern, "pieces": sorted(pieces), "chat_template": CHAT_TEMPLATE}
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(spec))
    subprocess.run([str(AIPERF_VENV / "bin" / "python"), "-c", _BUILD_TOKENIZER, str(spec_path), str(directory)],
                   check=True)
    spec_path.unlink()
    # The check that matters: the tokenizer counts a text's tokens exactly as the engine does.
    check = ("import sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
             "print(len(t.encode(sys.argv[2], add_special_tokens=False)))")
    sample = render_chat([{"role": "user", "content": corpus.read_text()[:5000]}])
    counted = subprocess.run([str(AIPERF_VENV / "bin" / "python"), "-c", check, str(directory), sample],
                             check=True, capture_output=True, text=True).stdout.strip()
    if int(counted) != tokens.count_tokens(sample):
        raise SystemExit(f"tokenizer mismatch: {counted} vs {tokens.count_tokens(sample)}")
    return directory


def start_engine(port: int, time_scale: float) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.sim_engine",
            "--log-level",
            "warning",
            "--port",
            str(port),
            "--time-scale",
            str(time_scale),
            "--model",
            MODEL,
        ]
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).raise_for_status()
            return process
        except httpx.HTTPError as error:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the simulated engine did not start") from error
            time.sleep(0.2)


def flush(url: str) -> None:
    httpx.post(url + "/flush_cache", timeout=10).raise_for_status()


def engine_ttft(url: str) -> tuple[float, float]:
    """The engine's own TTFT histogram (sum, count): request arrival → first token, no client in it."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for name in ("sum", "count"):
        match = re.search(rf"^sglang:time_to_first_token_seconds_{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        values[name] = float(match.group(1)) if match else 0.0
    return values["sum"], values["count"]


def _engine_mean(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count else None


def run_aiperf(binary: Path, url: str, tokenizer: Path, load: tuple[str, float], requests: int,
               args: argparse.Namespace, out: Path, seed: int) -> dict[str, Any]:
    mode, value = load
    shape = (["--concurrency", str(int(value)), "--warmup-request-count", str(int(value))] if mode == "concurrency"
             else ["--request-rate", str(value), "--arrival-pattern", "constant"])
    command = [
        str(binary),
        "profile",
        "--model",
        MODEL,
        "--url",
        url,
        "--endpoint-type",
        args.endpoint,
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--use-server-token-count",
        "--prompt-input-tokens-mean",
        str(args.input),
        "--prompt-input-tokens-stddev",
        "0",
        "--prompt-output-tokens-mean",
        str(args.output),
        "--prompt-output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        *shape,
        "--request-count",
        str(requests),
        # One prompt per request, warm-up included: aiperf deals its synthetic prompts without
        # replacement and reshuffles when they run out, and a repeated prompt is a full prefix-cache
        # hit (a ~20 ms TTFT that pulled its mean down at concurrency 1).
        "--num-dataset-entries",
        str(requests + (int(value) if mode == "concurrency" else 0)),
        "--random-seed",
        str(seed),
        "--goodput",
        f"time_to_first_token:{args.slo_ttft_ms} inter_token_latency:{args.slo_tpot_ms}",
        "--output-artifact-dir",
        str(out),
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]
    if args.endpoint == "chat":
        command.append("--apply-chat-template")
    started = time.perf_counter()
    # No HF_HUB_OFFLINE: with it aiperf looks the tokenizer up in the hub cache instead of the path.
    completed = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise SystemExit(f"aiperf failed ({completed.returncode}):\n{(completed.stdout + completed.stderr)[-3000:]}")
    export = next(out.rglob("profile_export_aiperf.json"))
    records = [json.loads(line)["metadata"] for line in next(out.rglob("profile_export.jsonl")).read_text().splitlines()
               if line.strip()]
    return {"metrics": _aiperf_metrics(json.loads(export.read_text())), "wall_s": wall, "command": " ".join(command),
            "reissue_p50_s": _reissue_p50(records, int(value)) if mode == "concurrency" else None}


def _reissue_p50(records: list[dict[str, Any]], concurrency: int) -> float | None:
    """aiperf's closed-loop re-issue delay: each send after the first `concurrency` minus the latest
    request end before it (the completion that freed its slot)."""
    ends = sorted(r["request_end_ns"] for r in records)
    starts = sorted(r["request_start_ns"] for r in records)[concurrency:]
    gaps = []
    for start in starts:
        before = [end for end in ends if end <= start]
        if before:
            gaps.append((start - before[-1]) / 1e9)
    gaps.sort()
    return gaps[len(gaps) // 2] if gaps else None


def _aiperf_metrics(export: dict[str, Any]) -> dict[str, dict[str, float]]:
    """aiperf's export → {tag: {stat: value in s, req/s or tok/s}} (it reports ms for latencies)."""
    found: dict[str, dict[str, float]] = {}
    records = export.get("records", export)
    for tag, entry in (records.items() if isinstance(records, dict) else ((m.get("tag"), m) for m in records)):
        if not isinstance(entry, dict):
            continue
        unit = str(entry.get("unit", ""))
        scale = 1e-3 if unit == "ms" else 1e-9 if unit == "ns" else 1.0
        found[tag] = {
            k: float(v) * scale for k, v in entry.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        found[tag]["unit"] = unit  # type: ignore[assignment]
    return found


def run_sweep(url: str, load: tuple[str, float], requests: int, args: argparse.Namespace, out: Path,
              mix: Path, think_s: float = 0.0) -> dict[str, Any]:
    mode, value = load
    shape = (["--concurrency", str(int(value)), "--warmup", str(int(value)), "--think-time-ms", f"{1000 * think_s:.3f}"]
             if mode == "concurrency" else ["--rate", str(value), "--arrival", "constant"])
    command = ["sweep", "--url", url, "--model", MODEL, "--mix", str(mix),
               *shape, "--requests", str(requests), "--endpoint", args.endpoint,
               "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
               "--out", str(out), "--no-plots", "--no-progress"]
    # The `inferbus` console script, run by this interpreter (the venv's, whatever PATH says).
    code = "import sys; from tools.commands.main import main; sys.argv[0] = 'inferbus'; main()"
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise SystemExit(f"inferbus sweep failed:\n{completed.stdout}\n{completed.stderr[-2000:]}")
    (step,) = json.loads((out / "sweep.json").read_text())["steps"]
    return {"step": step, "wall_s": wall, "command": "inferbus " + " ".join(command)}


def compare(aiperf: dict[str, dict[str, float]], step: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, tag, stat, path in COMPARED:
        theirs = aiperf.get(tag, {}).get(stat)
        ours: Any = step
        for key in path:
            ours = ours[key]
        if "(ms)" in label:
            theirs = None if theirs is None else theirs * 1000
            ours = None if ours is None else ours * 1000
        diff = None if theirs in (None, 0) or ours is None else (ours - theirs) / theirs
        rows.append({"metric": label, "aiperf": theirs, "inferbus": ours, "diff": diff,
                     "pass": diff is not None and abs(diff) <= TOLERANCE})
    return rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# inferbus sweep vs NVIDIA aiperf",
        "",
        f"Same simulated engine (H100 TP2, latency preset, time scale {results['time_scale']}), input "
        f"{results['input_tokens']} / output {results['output_tokens']} tokens, nothing cached, endpoint "
        f"`{results['endpoint']}`, streaming; aiperf {results['aiperf_version']} then `inferbus sweep`, one at a "
        "time, prefix cache flushed before each run. PASS: within ±5% of aiperf.",
        "",
        f"Machine: {results['machine']}. Generated by `python -m bench.sweep_vs_aiperf` on {results['date']}.",
        "",
    ]
    for run in results["runs"]:
        ours = run["inferbus"]["step"]
        matched = run.get("matched")
        lines += [
            f"## {run['mode']} {run['load']:g}{' req/s (constant arrivals)' if run['mode'] == 'rate' else ''}, "
            f"{run['requests']} requests",
            "",
            f"Server-reported ISL/OSL: aiperf {run['aiperf_isl']:.0f}/{run['aiperf_osl']:.0f}, inferbus "
            f"{run['inferbus_isl']:.0f}/{run['inferbus_osl']:.0f}. Our client: CPU {ours['client']['cpu_util']:.0%} "
            f"of a core, loop lag p99 {1000 * ours['client']['loop_lag_p99_s']:.1f} ms, "
            f"client_limited={ours['client_limited']}; load average {run['load_avg_1m']:.2f}."
            + (f" Closed-loop re-issue delay p50 (a request's end → the next send): aiperf "
               f"{_ms(run['aiperf']['reissue_p50_s'])}, inferbus {_ms(ours['client']['reissue_p50_s'])}."
               if run["mode"] == "concurrency" else "")
            + f" The engine's own TTFT mean over the run (arrival → first token, warm-up included): aiperf "
              f"{_ms(run['aiperf']['engine_ttft_mean_s'])}, inferbus {_ms(run['inferbus']['engine_ttft_mean_s'])}"
            + (f", inferbus with aiperf's re-issue delay {_ms(matched['engine_ttft_mean_s'])}." if matched else "."),
            "",
        ]

        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"

        def cells(row: dict[str, Any]) -> str:
            diff = "-" if row["diff"] is None else f"{100 * row['diff']:+.1f}%"
            return f"{fmt(row['inferbus'])} | {diff} | {'PASS' if row['pass'] else 'FAIL'}"

        if matched:
            think = 1000 * matched["think_s"]
            lines += [
                f"Judged at the same offered load: `inferbus sweep --think-time-ms {think:.1f}`, aiperf's measured "
                "re-issue delay (left). Right: our loop re-issuing at once, a slightly different load (see below).",
                "",
                f"| metric | aiperf | inferbus, think {think:.1f} ms | difference | within 5% "
                "| inferbus, re-issue at once | difference | within 5% |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
            for row, immediate in zip(matched["rows"], run["rows"]):
                lines.append(f"| {row['metric']} | {fmt(row['aiperf'])} | {cells(row)} | {cells(immediate)} |")
        else:
            lines += [
                "| metric | aiperf | inferbus sweep | difference | within 5% |",
                "| --- | --- | --- | --- | --- |",
            ]
            for row in run["rows"]:
                lines.append(f"| {row['metric']} | {fmt(row['aiperf'])} | {cells(row)} |")
        lines.append("")
    judged = [row for run in results["runs"] for row in (run["matched"]["rows"] if run.get("matched") else run["rows"])]
    immediate = [row for run in results["runs"] if run.get("matched") for row in run["rows"]]
    lines += [
        f"**{sum(r['pass'] for r in judged)}/{len(judged)} comparisons within 5% at the same offered load** "
        f"(closed loop with aiperf's re-issue delay, open loop as is). With our loop re-issuing at once: "
        f"{sum(r['pass'] for r in immediate)}/{len(immediate)} of the closed-loop comparisons.",
        "",
        "Why closed-loop TTFT differs more than the rest: a request that reaches the engine during a "
        "step waits for that step to end before it is scheduled, so its TTFT depends on where in a "
        "~20–45 ms step it arrives — on a real GPU engine as on the simulated one. In a closed loop each "
        "new request follows a completion, i.e. a step boundary, by the client's re-issue delay: aiperf "
        "routes every completion through its timing manager (separate processes over ZMQ) before it "
        "sends the next request (4–9 ms here), ours re-sends from the same coroutine (< 0.1 ms). A later "
        "send lands later in the step and waits less. The engine's own TTFT histogram (arrival → first "
        "token, no client in it; per run above) shows the difference is the server's, not a measurement "
        "error: in closed loop the engine itself served our requests' first tokens later by about what "
        "the clients report, while with open-loop arrivals both clients' engine-side means agree within "
        "~1 ms. Neither tool is wrong: they offer slightly different closed loops. So the closed-loop "
        "steps are judged with our client waiting aiperf's measured re-issue delay (`--think-time-ms`) "
        "before each next request, which offers the engine the same load. TPOT, ITL, E2E and "
        "throughput, which the engine's schedule sets, agree to within a fraction of a percent either way.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", default="10,48,128", help="requests per concurrency step (one per step)")
    # Rates whose arrival interval is no multiple of the ~19 ms step, so that constant arrivals meet
    # the engine's step clock at every phase (see the note in the results).
    parser.add_argument("--rates", default="1.13,2.37", help="open-loop steps (constant arrivals); '' for none")
    parser.add_argument("--rate-requests", default="30,60", help="requests per rate step")
    parser.add_argument("--input", type=int, default=1000)
    parser.add_argument("--output", type=int, default=200)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--slo-ttft-ms", type=float, default=800.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests.split(",")]
    rates = [float(r) for r in args.rates.split(",") if r]
    rate_counts = [int(n) for n in args.rate_requests.split(",") if n]
    if len(counts) != len(levels) or len(rate_counts) < len(rates):
        parser.error("--requests (--rate-requests) needs one count per --concurrency (--rates) step")
    loads = [("concurrency", float(c)) for c in levels] + [("rate", r) for r in rates]
    load_counts = counts + rate_counts[: len(rates)]

    binary = ensure_aiperf()
    from inferbus.local.ports import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runs = []
    with tempfile.TemporaryDirectory(prefix="sweep-vs-aiperf-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "tokenizer").mkdir()
        tokenizer = build_tokenizer(tmp / "tokenizer")
        mix = tmp / "fixed.yaml"
        mix.write_text(f"name: fixed-{args.input}-{args.output}\nclasses:\n  - name: fixed\n"
                       f"    input_tokens: {args.input}\n    output_tokens: {args.output}\n")
        engine = start_engine(port, args.time_scale)
        try:
            for index, (load, requests) in enumerate(zip(loads, load_counts)):
                name = f"{load[0]} {load[1]:g}"
                print(f"{name}: aiperf ({requests} requests) …", flush=True)
                flush(url)
                before = engine_ttft(url)
                theirs = run_aiperf(binary, url, tokenizer, load, requests, args, tmp / f"aiperf-{index}", seed=index)
                theirs["engine_ttft_mean_s"] = _engine_mean(before, engine_ttft(url))
                print(f"{name}: inferbus sweep …", flush=True)
                flush(url)
                before = engine_ttft(url)
                ours = run_sweep(url, load, requests, args, tmp / f"sweep-{index}", mix)
                ours["engine_ttft_mean_s"] = _engine_mean(before, engine_ttft(url))
                step = ours["step"]
                metrics = theirs["metrics"]
                matched = None
                if load[0] == "concurrency" and theirs["reissue_p50_s"]:
                    think = theirs["reissue_p50_s"]
                    print(f"{name}: inferbus sweep --think-time-ms {1000 * think:.1f} (aiperf's re-issue delay) …",
                          flush=True)
                    flush(url)
                    before = engine_ttft(url)
                    matched = run_sweep(url, load, requests, args, tmp / f"sweep-matched-{index}", mix, think_s=think)
                    matched["engine_ttft_mean_s"] = _engine_mean(before, engine_ttft(url))
                    matched["think_s"] = think
                    matched["rows"] = compare(metrics, matched["step"])
                runs.append({
                    "mode": load[0], "load": load[1], "requests": requests,
                    "aiperf_isl": metrics.get("input_sequence_length", {}).get("avg", float("nan")),
                    "aiperf_osl": metrics.get("output_sequence_length", {}).get("avg", float("nan")),
                    "inferbus_isl": step["input_tok_s"] / step["request_rps"],
                    "inferbus_osl": step["output_tok_s"] / step["request_rps"],
                    "load_avg_1m": os.getloadavg()[0],
                    "rows": compare(metrics, step), "aiperf": theirs, "inferbus": ours, "matched": matched,
                })
                for row in (matched or runs[-1])["rows"]:
                    print(f"  {row['metric']:32s} aiperf {row['aiperf']!s:>22s} ours {row['inferbus']!s:>22s} "
                          f"{'PASS' if row['pass'] else 'FAIL'}", flush=True)
        finally:
            engine.terminate()
            engine.wait(10)
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "aiperf_version": AIPERF_VERSION,
        "machine": f"{os.cpu_count()} cores, 1-minute load average at the end {os.getloadavg()[0]:.2f}",
        "time_scale": args.time_scale, "input_tokens": args.input, "output_tokens": args.output,
        "endpoint": args.endpoint, "tolerance": TOLERANCE, "runs": runs,
    }
    write_results(args.out, "sweep_vs_aiperf", results, markdown)


def rewrite_markdown(out: Path = ROOT / "bench" / "results") -> None:
    """Regenerate the markdown from the JSON (after a change to `markdown`)."""
    (out / "sweep_vs_aiperf.md").write_text(markdown(json.loads((out / "sweep_vs_aiperf.json").read_text())))


if __name__ == "__main__":
    main()
