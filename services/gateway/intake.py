"""What the gateway makes of a request it admits, pure: the engine request (one per choice) and
the client's error for a failed stream. `generation.Generation._admit` runs the admission checks
in this order, the cheapest refusal first and nothing held for a request refused later:

1. the API key (401) and its tenant (403), before the body is read;
2. the body within its limits (413), parsed and validated (400): a large one in a thread;
3. the model or adapter the tenant may use (404);
4. the prompt rendered with the model's own chat template and tokenized once (400 `invalid_prompt`);
5. `max_tokens` against the context window (400), before any work per token;
6. the adapter's version (canaries): its name is part of the engine name the prefix hashes are made in;
7. workers serving the model (503 `no_capacity`);
8. platform overload (`overload.OverloadPolicy`, 503 `overloaded`): before quotas, so that a
   request the platform sheds uses none of its tenant's;
9. the base model's release, then the tenant's quotas and budget (429), which reserve its tokens;
10. sampling parameters the engine can carry (400), which hands the reservation back;
11. dispatch: one flight per choice, each beside the first.
"""

from __future__ import annotations

import msgspec

from inferbus.openai import schemas
from inferbus.openai.errors import OpenAIError
from inferbus.openai.sampling import sampling_params
from inferbus.stores.keys import Principal
from inferbus.tokens.prompt import Prompt
from proto import bands
from proto import messages as m


def inference_request(params: schemas.ChatCompletionRequest | schemas.CompletionRequest, *, request_id: str,
                      principal: Principal, model: str, adapter: str | None, band: bands.Band, prompt: Prompt,
                      max_new_tokens: int, tool_call_parser: str, reply_to: str, timeout_s: float, now: float,
                      release: str | None, release_pinned: bool, adapter_canary: bool, adapter_pinned: bool,
                      adapter_fallback: str | None) -> m.InferenceRequest:
    """The engine request of an admitted chat or completion request (`params`), its deadline
    `timeout_s` from `now`."""
    return m.InferenceRequest(
        request_id=request_id,
        tenant=principal.tenant,
        model=model,
        prompt=prompt.text,
        kind="chat" if isinstance(params, schemas.ChatCompletionRequest) else "completion",
        api_key_id=principal.key_id,
        adapter=adapter,
        band=band,
        priority=bands.ENGINE_PRIORITY[band],
        sampling=sampling_params(params, max_new_tokens, tool_call_parser),
        reply_to=reply_to,
        deadline=now + timeout_s,
        created=now,
        prompt_tokens=len(prompt.ids),
        input_ids=prompt.ids,
        release=release,
        release_pinned=release_pinned,
        adapter_canary=adapter_canary,
        adapter_pinned=adapter_pinned,
        adapter_fallback=adapter_fallback,
        user=params.user or (params.safety_identifier if isinstance(params, schemas.ChatCompletionRequest) else None),
    )


def event_error(event: m.StreamEvent) -> OpenAIError:
    if isinstance(event, m.StreamError):
        status = event.status if event.status in (400, 404, 408, 413, 422, 429, 500, 502, 503, 504) else 500
        headers = {"retry-after": "1"} if status in (429, 503) else None
        return OpenAIError(status, event.message, code=event.code, headers=headers)
    return OpenAIError(503, "The request could not be completed; retry shortly.", code="worker_lost")


def choice_request(request: m.InferenceRequest, index: int) -> m.InferenceRequest:
    """The engine request of choice `index` of n: the first is the request itself; the others get
    their own id and seed (equal seeds would give n equal samples) and bill no prompt tokens, which
    OpenAI counts once."""
    if index == 0:
        return request
    seed = request.sampling.seed
    if seed is not None:
        seed = (seed + index + 2**63) % 2**64 - 2**63  # stays in int64
    return msgspec.structs.replace(request, request_id=f"{request.request_id}.c{index}", choice=index,
                                   sampling=msgspec.structs.replace(request.sampling, seed=seed))
