"""Continuing a request from what it already produced. Pure: no I/O, no clock.

A request that stops part-way (its worker died, it was preempted for interactive work, a drain
handed it back) runs again as its next attempt. The next attempt does not regenerate what exists:
its engine input is the prompt plus everything generated so far, and its output budget is what is
left. The gateway's migration, the worker's requeue of a batch line and the fleet simulator's
recovery all build their next attempt here.

Two forms of the same rule:

- `next_attempt` on the bus message (`InferenceRequest`): what an attempt produced is carried in
  `resumed_text`, `resumed_ids` and `resumed_tokens`;
- `engine_input` on token ids: what the engine is given for an attempt (the worker's engine
  client, and the simulator, which has no bus messages).

Constrained output (a JSON schema, a regex) cannot continue from text: the grammar would start
over in the middle of it, so its next attempt starts the output over.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from proto import messages as m


def next_attempt(
    request: m.InferenceRequest,
    *,
    text: str,
    token_ids: Sequence[int],
    produced_tokens: int,
    prompt_tokens: int | None,
) -> m.InferenceRequest:
    """The attempt after `request`, continuing from its output so far.

    `text` and `token_ids` are what this attempt generated (after `request.resumed_text` /
    `resumed_ids`), `produced_tokens` the output tokens of all attempts so far, `prompt_tokens`
    the prompt's length as counted (without the resumed output).
    """
    if request.sampling.constrained:
        return msgspec.structs.replace(
            request, attempt=request.attempt + 1, resumed_text="", resumed_ids=[], resumed_tokens=0,
            prompt_tokens=prompt_tokens, expected_cached_tokens=0,
        )
    # From token ids (re-tokenized text may split differently), unless the ids of everything this
    # attempt produced are not known (an engine that does not report output ids): then from text.
    ids_complete = bool(request.input_ids) and len(token_ids) == produced_tokens - request.resumed_tokens
    return msgspec.structs.replace(
        request,
        attempt=request.attempt + 1,
        resumed_text=request.resumed_text + text,
        input_ids=request.input_ids if ids_complete else [],
        resumed_ids=[*request.resumed_ids, *token_ids] if ids_complete else [],
        resumed_tokens=produced_tokens,
        prompt_tokens=prompt_tokens,
        # Where the cache is has to be found again for the new attempt (placement sets it).
        expected_cached_tokens=0,
    )


def engine_input(prompt_ids: list[int], produced_ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
    """(input ids, output budget) an engine gets for an attempt that continues after `produced_ids`."""
    return (prompt_ids + produced_ids if produced_ids else prompt_ids), max_new_tokens - len(produced_ids)
