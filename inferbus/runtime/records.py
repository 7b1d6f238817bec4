"""Reading a stored record that may not decode.

A KV value or Redis record can be damaged (a writer with a bug, an operator's hand edit, a
server answer written where a record belongs). One such record must not turn every read of its
tenant into a 5xx: the stores read it as absent (a 404 for a get, a skip in a list), log it and
count it in `inferbus_bad_records_total{store=...}`, so an operator finds and removes it.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import msgspec
from prometheus_client import Counter

from inferbus.runtime import logs

log = logs.get(__name__)

T = TypeVar("T", covariant=True)  # what a decoder yields

BAD_RECORDS = Counter(
    "inferbus_bad_records_total",
    "Stored records that did not decode and were read as absent, by store",
    ["store"],
)


class Decoder(Protocol[T]):
    def decode(self, buf: bytes, /) -> T: ...


def decode_or_none(decoder: Decoder[T], value: bytes | str, *, store: str, key: str) -> T | None:
    """`decoder.decode(value)`, or None (logged and counted) when the value does not decode."""
    try:
        return decoder.decode(value.encode() if isinstance(value, str) else value)
    except (msgspec.DecodeError, UnicodeDecodeError) as error:
        BAD_RECORDS.labels(store=store).inc()
        log.warning("bad_record", store=store, key=key, error=str(error)[:200], bytes=len(value))
        return None
