"""What the native endpoints answer, as SGLang 0.5.23 writes it: `/generate`'s payload,
`/server_info`, `/model_info` and `/v1/loads`. Pure: the shell (`server.py`) passes in the clock
readings and the tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .config import EngineConfig
from .request import LoadSnapshot, Request, RequestUpdate

SGLANG_VERSION = "0.5.23"


def generate_payload(request: Request, update: RequestUpdate, e2e_latency: float | None,
                     token_text: Callable[[int], str] | None = None) -> dict[str, Any]:
    """One `/generate` answer or stream event: the text so far, its ids and `meta_info`
    (`e2e_latency` on the final one). `token_text`: a token decoded alone, for the logprobs'
    text (with a SentencePiece-style tokenizer it lacks the leading space it has in the text)."""
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": update.finish_reason,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": update.num_output_tokens,
        "cached_tokens": request.cached_tokens,
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if request.return_logprob:
        # Cumulative like the text, [logprob, token id, text] (text only with return_text_in_logprobs).
        n = update.num_output_tokens
        meta["output_token_logprobs"] = [logprob_entry(e, token_text) for e in request.token_logprobs[:n]]
        meta["output_top_logprobs"] = [[logprob_entry(t, token_text) for t in top] for top in request.top_logprobs[:n]]
    return {"text": update.text, "output_ids": request.output_ids[: update.num_output_tokens], "meta_info": meta}


def logprob_entry(entry: tuple[float, int, str], token_text: Callable[[int], str] | None) -> list[Any]:
    """A logprob entry as SGLang's return_text_in_logprobs writes it: the token decoded alone."""
    logprob, token_id, text = entry
    if token_text is not None:
        text = token_text(token_id)
    return [logprob, token_id, text]


def server_info(config: EngineConfig, capacity_tokens: int, time_scale: float, eval_accuracy: float) -> dict[str, Any]:
    """`/server_info`: SGLang's server args and internal state, and what the simulator runs."""
    return {
        "model_path": config.model,
        "served_model_name": config.model,
        "tp_size": config.tp,
        "dp_size": 1,
        "chunked_prefill_size": config.chunked_prefill_size,
        # SGLang reports the flag here (null unless given) and the effective value per
        # data-parallel rank in internal_states.
        "max_running_requests": config.max_running_requests if config.max_running_requests_set else None,
        "internal_states": [{"effective_max_running_requests_per_dp": config.max_running_requests,
                             "last_gen_throughput": 0.0}],
        "max_total_num_tokens": capacity_tokens,
        "page_size": config.block_size,
        "max_loras_per_batch": config.max_loras_per_batch,
        "max_loaded_loras": config.max_loaded_loras,
        "lora_eviction_policy": config.lora_eviction_policy,
        "enable_lora_overlap_loading": config.lora_overlap_loading,
        "enable_lora": True,
        "enable_priority_scheduling": config.priority_scheduling,
        "enable_mixed_chunk": config.mixed_chunk,
        # As SGLang: the flag (null unless given), and the longest prompt the scheduler takes,
        # min(context length, KV pool) - 6, which is how a client learns the window.
        "context_length": config.context_length if config.context_length_set else None,
        "max_req_input_len": min(config.context_length, capacity_tokens) - 6,
        "version": SGLANG_VERSION,
        "inferbus_simulated": True,
        "gpu": config.gpu,
        "preset": config.preset,
        "time_scale": time_scale,
        "fixed_step_ms": config.fixed_step_ms,
        "profile_table": config.profile_table,
        # What a release pins (SGLang reports its server args here too).
        "tokenizer_path": config.model_dir or config.model,
        "quantization": config.quantization,
        "kv_cache_dtype": config.kv_cache_dtype,
        "speculative_num_steps": config.speculative_num_steps,
        "sim_eval_accuracy": eval_accuracy,
    }


def model_info(config: EngineConfig) -> dict[str, Any]:
    return {
        "model_path": config.model,
        "tokenizer_path": config.model_dir or config.model,
        "is_generation": True,
    }


def loads(snapshot: LoadSnapshot, timestamp: float) -> dict[str, Any]:
    """`/v1/loads`: the one data-parallel rank's load."""
    return {
        "timestamp": timestamp,
        "version": SGLANG_VERSION,
        "dp_rank_count": 1,
        "loads": [{"dp_rank": 0, **asdict(snapshot)}],
    }
