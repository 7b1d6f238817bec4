"""Admission and retraction choices of the simulated scheduler, pure: how much free KV a waiting
request needs to be scheduled, and which running request is retracted first."""

from __future__ import annotations

from collections.abc import Iterable

from .request import Request

# Admission reserves room for this share of each running request's remaining output (capped per
# request), like SGLang's new_token_ratio estimate; an underestimate is fixed by retraction.
NEW_TOKEN_RATIO = 0.3
CLIP_MAX_NEW_TOKENS_ESTIMATE = 4096


def prompt_room(request: Request, cached: int, running: Iterable[Request]) -> int:
    """KV tokens a waiting request needs free to be scheduled: the whole uncached prompt (as
    SGLang checks it, though it prefills a chunk at a time), the rest of the prompts being
    prefilled, and a share of every running request's remaining output."""
    running = list(running)
    needed = len(request.fill_ids) - cached + 1
    needed += sum(len(r.fill_ids) - r.computed for r in running if r.prefilling)
    needed += int(
        NEW_TOKEN_RATIO
        * sum(min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS_ESTIMATE) for r in (*running, request))
    )
    return needed


def choose_victim(running: Iterable[Request]) -> Request:
    """The running request retracted first: lowest priority; among equals the newest, which has
    the least work to redo."""
    return min(running, key=lambda r: (r.priority, -r.order))
