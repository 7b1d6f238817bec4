"""Adapter registrations: pinned versions only, names that stay one KV key, engine names."""

import pytest

from inferbus.stores import adapters

DIGEST = "sha256:" + "0123456789abcdef" * 4


def test_a_pinned_digest_is_required() -> None:
    spec = adapters.new_spec("acme/support-v2", "base", DIGEST, "s3://weights/support")
    assert spec.engine_name == "acme/support-v2@0123456789ab"
    for version in ("latest", "v2", "sha256:abc", "SHA256:" + "0" * 64, "sha256:" + "g" * 64):
        with pytest.raises(adapters.InvalidAdapter, match="pinned digest"):
            adapters.new_spec("x", "base", version, "p")


def test_names_are_checked_and_map_to_safe_unique_keys() -> None:
    for name in ("", "a b", "x@y", "base:adapter", "-leading"):
        with pytest.raises(adapters.InvalidAdapter):
            adapters.new_spec(name, "base", DIGEST, "p")
    keys = {adapters.key(name) for name in ("a/b", "a.b", "a_b", "a-b", "A.b")}
    assert len(keys) == 5
    assert all(set(key) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_") for key in keys)
