"""Logprob token text decoded in context (inferbus.openai.token_text): the tokens join up to the
content with a SentencePiece-style tokenizer, whose tokens decoded alone lose their leading space."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from inferbus.openai.token_text import TokenTexts
from proto import messages as m

from .spm import sentencepiece_style

TEXT = "the weather in Zürich is fine 😀 today, the fox said"


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    """A SentencePiece-style BPE, shaped like Llama-2's and Mistral's tokenizer.json: `▁` marks a
    word's leading space, bytes of characters outside the vocabulary fall back to `<0xNN>` tokens."""
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, the weather is fine today"] * 20
    tokenizer = sentencepiece_style(corpus, 120, ["<unk>", "<s>", "</s>"])
    return tokenizer


def _engine_entries(tokenizer: Tokenizer, ids: list[int]) -> list[m.TokenLogprob]:
    """What SGLang reports with return_text_in_logprobs: each token decoded alone; the token's
    neighbour as an alternative."""
    return [m.TokenLogprob(token=tokenizer.decode([i]), logprob=-0.5, token_id=i,
                           top=[(tokenizer.decode([i]), -0.5), (tokenizer.decode([ids[0]]), -1.5)], top_ids=[i, ids[0]])
            for i in ids]


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("prompt", ["", "a long prompt: tell me of the weather"])
def test_tokens_join_up_to_the_content(spm: Tokenizer, chunk: int, prompt: str) -> None:
    ids = spm.encode(TEXT).ids
    prompt_ids = spm.encode(prompt).ids if prompt else []
    # The content as SGLang's detokenizer writes it: the output decoded after the prompt's last 5 tokens.
    tail = prompt_ids[-5:]
    content = spm.decode(tail + ids)[len(spm.decode(tail)):]
    assert content.startswith(" the") if prompt else content.startswith("the")
    entries = _engine_entries(spm, ids)
    assert "".join(e.token for e in entries) != content  # decoded alone, the spaces are lost
    texts = TokenTexts(lambda token_ids: spm.decode(list(token_ids)), prompt_ids)
    rewritten = [e for i in range(0, len(entries), chunk) for e in texts.rewrite(entries[i:i + chunk])]
    assert "".join(e.token for e in rewritten) == content
    words = [e.token for e in rewritten]
    assert " weather" in words and " today" in words
    # The bytes of one character give nothing until the last, which carries the character.
    assert "😀" in words and "ü" in words and "\ufffd" not in "".join(words)
    # Alternatives read as they would continue the text: the same token, and `the` after a space.
    assert all(e.top[0][0] == e.token for e in rewritten if e.token)
    assert all(e.top[1][0] == " the" for e in rewritten[1 if not prompt else 0:] if e.token.startswith(" "))
    assert [e.logprob for e in rewritten] == [e.logprob for e in entries]


def test_entries_without_ids_keep_the_engines_text(spm: Tokenizer) -> None:
    texts = TokenTexts(lambda token_ids: spm.decode(list(token_ids)))
    entries = [m.TokenLogprob(token="x", logprob=-1.0), m.TokenLogprob(token="y", logprob=-2.0, top=[("z", -3.0)])]
    assert texts.rewrite(entries) == entries


def test_an_output_cut_inside_a_character_ends_as_the_engines_text(spm: Tokenizer) -> None:
    """Cut at max_tokens between the bytes of one character, SGLang's final text ends with what those
    bytes decode to (the replacement character): the last token gives it, so the tokens still join up."""
    ids = spm.encode("fine 😀").ids
    cut = ids[:-1]  # the emoji's last byte never comes
    content = spm.decode(cut)
    assert content.endswith("\ufffd")
    entries = _engine_entries(spm, cut)
    streamed = TokenTexts(lambda token_ids: spm.decode(list(token_ids)))
    tokens = [e.token for e in streamed.rewrite(entries[:-2])] + [
        e.token for e in streamed.rewrite(entries[-2:], final=True)
    ]
    assert "".join(tokens) == content
    # Not final: the bytes wait for the token that would complete the character.
    assert (
        "".join(e.token for e in TokenTexts(lambda token_ids: spm.decode(list(token_ids))).rewrite(entries)) == "fine "
    )
