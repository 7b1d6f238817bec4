"""The output a request's prompt decides up front, before any step runs: a value of the requested
JSON schema, the answer to an arithmetic question, or the tool call the prompt asks for. Pure and
deterministic under the sampling seed (else under the prompt)."""

from __future__ import annotations

import random
from collections.abc import Callable

from . import quality
from .constrained import json_output, tool_call_output
from .sampling import SamplingParams


def scripted_output(text: str, input_ids: list[int], sampling: SamplingParams, rid: str,
                    accuracy: Callable[[], float], tool_call_parser: str) -> str | None:
    """The decided output, or None (free text). `accuracy`: the model's (or its adapter's), read
    only when an answer is looked for. SchemaError if the JSON schema cannot compile."""
    seed = sampling.sampling_seed if sampling.sampling_seed is not None else hash(tuple(input_ids[-256:]))
    rng = random.Random(seed)
    if sampling.json_schema is not None:
        return json_output(sampling.json_schema, rng, text)
    if sampling.regex is None and sampling.ebnf is None:
        solved = quality.answer(text, accuracy(), sampling.sampling_seed if sampling.sampling_seed is not None else rid)
        if solved is not None:
            return solved
        return tool_call_output(text, tool_call_parser, rng)
    return None
