"""A SentencePiece-style tokenizer built in the test, shaped like Llama-2's and Mistral's
tokenizer.json: `▁` marks a word's leading space (decoding a token alone drops it), bytes of
characters outside the vocabulary fall back to `<0xNN>` tokens."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def sentencepiece_style(corpus: Sequence[str], vocab_size: int, special_tokens: Sequence[str]) -> Tokenizer:
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens)))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer
