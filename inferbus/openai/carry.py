"""Can the bus carry a request? Pure: a request's sampling parameters in, a 400 or nothing out.

Bus messages are MessagePack, whose integers are 64-bit: a JSON integer such as `seed` = 2**70
decodes in Python but cannot be encoded, and a request that cannot be encoded can never be
published, however often it is retried. The gateway and the batch service check every request
they build with this, so such a request is the client's 400 (or its batch line's error) at once.
"""

from __future__ import annotations

import msgspec

from inferbus.openai.errors import OpenAIError
from proto import messages as m

# What msgspec's MessagePack encoder raises for a value it cannot represent (an integer beyond
# 64 bits, a string with lone surrogates, a type it does not know).
UNENCODABLE = (OverflowError, ValueError, TypeError, msgspec.EncodeError)


def check_sampling(sampling: m.SamplingParams) -> None:
    """OpenAIError 400 naming the parameter when `sampling` cannot be encoded for the bus."""
    try:
        m.encode(sampling)
    except UNENCODABLE as error:
        param = _culprit(sampling)
        what = f"`{param}`" if param else "A sampling parameter"
        raise OpenAIError(400, f"{what} cannot be carried to the engine: {error}.", param=param,
                          code="invalid_value") from None


def _culprit(sampling: m.SamplingParams) -> str | None:
    # The request's own name for the field (`max_tokens`, not the engine's `max_new_tokens`).
    for field in sampling.__struct_fields__:
        try:
            msgspec.msgpack.encode(getattr(sampling, field))
        except UNENCODABLE:
            return "max_tokens" if field == "max_new_tokens" else field
    return None
