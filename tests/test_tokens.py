from inferbus.tokens import blocks as tokens
from inferbus.tokens.blocks import standin_render_chat as render_chat


def test_encoding_is_stable_and_bpe_sized() -> None:
    text = "The quick brown fox jumps over the lazy dog, 12345 times."
    assert tokens.encode(text) == tokens.encode(text)
    words = len(text.split())
    assert words <= len(tokens.encode(text)) <= 2.5 * words
    assert tokens.count_tokens(text) == len(tokens.encode(text))


def test_block_hashes_chain_so_equal_hashes_mean_equal_prefixes() -> None:
    a = tokens.block_hashes(list(range(64)), 16)
    b = tokens.block_hashes(list(range(48)) + [999] * 16, 16)
    assert len(a) == 4
    assert a[:3] == b[:3] and a[3] != b[3]
    assert tokens.block_hashes(list(range(40)), 16) == a[:2]  # partial blocks are not hashed
    assert tokens.block_hashes(list(range(64)), 16, namespace="lora-x") != a


def test_chat_rendering_is_canonical() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    rendered = render_chat(messages)
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>system")
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render_chat(messages, tools=[{"b": 1, "a": 2}]) == render_chat(messages, tools=[{"a": 2, "b": 1}])
