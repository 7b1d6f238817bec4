"""Logprob token text that joins up to the content, whatever the tokenizer. Pure: the tokenizer's
decoding is passed in.

An engine reports each generated token's text as the token decoded alone (SGLang's
`return_text_in_logprobs`). With a SentencePiece-style tokenizer that drops the token's leading
space (`▁the` alone decodes to `the`), so the tokens no longer join up to the content, which the
engine decodes as a whole. Decoded in context instead, a token's text is what it adds to the
decoding of the tokens before it: the decoding of (previous tokens + it) minus that of the previous
tokens, over a short window. A token that ends inside a character (byte-fallback pieces of one
UTF-8 character) adds nothing until the token that completes it, which carries the whole character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proto import messages as m

_INCOMPLETE = "\ufffd"  # what a decoder writes for bytes that are not yet a whole character
# Prompt tokens the output is decoded after (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT = 5


class TokenTexts:
    """One choice's generated tokens, in order, decoded in context (an instance per choice)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int] = ()) -> None:
        self.decode = decode
        # The output is decoded after the prompt's last tokens, as SGLang's detokenizer decodes it
        # (so the first token keeps its leading space in the content too).
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        # ids[prefix:read]: the tokens whose text was given last, the context a new token is decoded
        # after; ids[read:]: tokens that ended inside a character, their text not given yet.
        self.prefix = 0
        self.read = len(self.ids)

    def _added(self, ids: list[int], context_text: str) -> str | None:
        """What `ids` add to `context_text` (the decoding of their first tokens); None while they end
        inside a character."""
        text = self.decode(ids)
        if text.endswith(_INCOMPLETE) or not text.startswith(context_text):
            return None
        return text[len(context_text):]

    def rewrite(self, entries: Sequence[m.TokenLogprob]) -> list[m.TokenLogprob]:
        """`entries` (the next generated tokens) with their text and their alternatives' decoded in
        context; an entry without a token id keeps the engine's text."""
        out = []
        for entry in entries:
            if entry.token_id < 0:
                out.append(entry)
                continue
            context_text = self.decode(self.ids[self.prefix:self.read])
            before = self.ids[self.prefix:]
            top = [(alternative if (text := self._added([*before, alternative_id], context_text)) is None else text,
                    logprob)
                   for (alternative, logprob), alternative_id in zip(entry.top, entry.top_ids, strict=False)]
            top += entry.top[len(top):]
            self.ids.append(entry.token_id)
            added = self._added(self.ids[self.prefix:], context_text)
            if added is None:
                token = ""  # all of the character comes with the token that completes it
            else:
                token = added
                self.prefix, self.read = self.read, len(self.ids)
            out.append(m.TokenLogprob(token=token, logprob=entry.logprob, top=top,
                                      token_id=entry.token_id, top_ids=entry.top_ids))
        return out
