"""What the simulated model says, as functions of the context: the output vocabulary, each token's
logprobs, where free text ends by itself, and when a request is finished (SGLang's finish reasons)."""

from __future__ import annotations

import math
import random
import struct
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferbus.tokens.blocks import encode, pieces

from .config import ANSWER_LENGTH_SIGMA
from .request import Request

EOS_TOKEN_ID = 128009  # Llama-3's <|eot_id|>: the finish `matched` of an output that ended by itself


# Output vocabulary: common English words (each one stand-in token), with punctuation and
# newlines mixed in so that stop sequences such as "." or "\n" do match.
_WORDS = """
the of and to in is you that it he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their
if will up other about out many then them these so some her would make like him into time has
look two more write go see number no way could people my than first water been call who oil its
now find long down day did get come made may part over new sound take only little work know place
year live me back give most very after thing our just name good man think say great where help
much before line right too mean old any same tell boy follow came want show also around form three
small set put end does well large must big even such turn here why ask went men read need land
differ home us move try kind hand again change off play spell air away animal house point page
letter mother answer found study still learn should world high every near add food own below
plant last school father keep tree never start city earth eye light though head under story saw
left few while along might close open seem next hard begin life always those both paper often run
music color stand sun fish area mark dog horse birds told knew pass since top whole king space
heard best hour better true during step early hold west ground reach fast five sing listen six
table travel less ten simple toward war lay slow center love person money serve appear road map
rain rule govern pull cold notice voice unit power town fine drive lead cry dark note wait plan
figure star box noun field rest able pound done beauty stood front teach week final gave green
quick ocean warm free minute strong mind behind clear tail fact street inch course stay wheel full
force blue object decide deep moon island foot system busy test record boat common gold plane age
dry wonder laugh ago ran check game shape yes hot miss heat snow tire bring fill east paint among
""".split()
OUTPUT_PIECES: tuple[str, ...] = (
    tuple(" " + word for word in _WORDS if len(word) <= 6)
    + ("." ,) * 24
    + ("," ,) * 16
    + ("\n",) * 6
)
_PIECE_IDS: dict[str, int] = {piece: encode(piece)[0] for piece in set(OUTPUT_PIECES)}


@dataclass(frozen=True)
class OutputVocabulary:
    """The (token id, text) pairs output is drawn from: single tokens of the served model's
    vocabulary, so that output_ids decode to the text, or the stand-in tokenizer's pieces; how an
    output decided up front (a JSON value, a tool call) splits into tokens; the EOS token id."""

    tokens: tuple[tuple[int, str], ...]
    split: Callable[[str], list[tuple[int, str]]]
    eos_id: int

    @classmethod
    def standin(cls) -> OutputVocabulary:
        return cls(tuple((_PIECE_IDS[piece], piece) for piece in OUTPUT_PIECES),
                   lambda text: [(encode(piece)[0], piece) for piece in pieces(text)], EOS_TOKEN_ID)

    @classmethod
    def from_tokenizer(cls, encode_text: Callable[[str], list[int]], decode_id: Callable[[int], str],
                       eos_id: int) -> OutputVocabulary:
        """The output pieces that are one token of the model's vocabulary (readable words); with
        too few of those (a tiny vocabulary), every piece's tokens. A token's text is its decoding,
        so output ids always decode to the text."""

        def split(text: str) -> list[tuple[int, str]]:
            return [(token_id, decode_id(token_id)) for token_id in encode_text(text)]

        per_piece = [split(piece) for piece in OUTPUT_PIECES]
        whole = [tokens[0] for tokens in per_piece if len(tokens) == 1]
        if len({text for _, text in whole}) >= 32:
            return cls(tuple(whole), split, eos_id)
        return cls(tuple(token for tokens in per_piece for token in tokens), split, eos_id)


STANDIN_VOCABULARY = OutputVocabulary.standin()


_TOKEN = struct.Struct("<I")


def extend_context_hash(context_hash: int, token_id: int) -> int:
    """The context's hash with one more output token (crc32 is incremental)."""
    return zlib.crc32(_TOKEN.pack(token_id), context_hash)


def record_logprobs(request: Request, mixed: int, piece: str, token_id: int,
                     vocabulary: tuple[tuple[int, str], ...]) -> None:
    """Plausible logprobs, a function of the context: the emitted token is the most likely one
    (from about -0.01 to -2.5) and the alternatives, tokens of the output vocabulary, fall off
    behind it."""
    logprob = -0.01 - ((mixed >> 4) % 250) / 100
    request.token_logprobs.append((logprob, token_id, piece))
    top: list[tuple[float, int, str]] = []
    if request.top_logprobs_num:
        top.append((logprob, token_id, piece))
        distinct = len({text for _, text in vocabulary} | {piece})
        step = 0
        while len(top) < min(request.top_logprobs_num, distinct):
            step += 1
            other_id, other = vocabulary[(mixed + step * 7919) % len(vocabulary)]
            if any(other == t[2] for t in top):
                continue
            top.append((logprob - 0.5 * step - ((mixed >> step) % 50) / 100, other_id, other))
    request.top_logprobs.append(top)


def context_hash(request: Request) -> int:
    """Greedy output depends on the context and the adapter (its weights change the model);
    sampled output also on the seed (or the rid)."""
    salt = zlib.crc32(request.lora_name.encode()) if request.lora_name else 0
    if request.sampling.temperature != 0.0:
        seed = request.sampling.sampling_seed if request.sampling.sampling_seed is not None else request.rid
        salt = zlib.crc32(str(seed).encode(), salt)
    # crc32 is incremental: hashing the prompt then each output id equals hashing them all at once.
    return zlib.crc32(array("I", request.input_ids).tobytes(), salt)



def answer_length(request: Request, median: int) -> int:
    """Where the model would end its free text by itself: drawn from the configured
    distribution (`median` tokens), seeded by the context (so a greedy request answers alike every
    time, a sampled one by its seed); 0 with ignore_eos or without a distribution."""
    if median <= 0 or request.sampling.ignore_eos:
        return 0
    draw = random.Random(request.context_hash).gauss(0.0, 1.0)
    return max(1, round(median * math.exp(ANSWER_LENGTH_SIGMA * draw)))


def check_finished(request: Request, token_id: int, previous_len: int,
                   eos_id: int) -> tuple[dict[str, Any] | None, str]:
    """Whether the token just emitted (`previous_len`: the text's length before it) ends the request,
    with SGLang's finish reason, and the text to keep (a matched stop string trimmed off unless
    no_stop_trim)."""
    text = request.text
    generated = len(request.output_ids)
    if request.script is not None and generated >= len(request.script):
        return {"type": "stop", "matched": eos_id}, text
    if generated >= request.max_new_tokens:
        return {"type": "length", "length": request.max_new_tokens}, text
    sampling = request.sampling
    if generated < sampling.min_new_tokens:
        return None, text
    if sampling.stop_token_ids and token_id in sampling.stop_token_ids:
        return {"type": "stop", "matched": token_id}, text
    if request.script is None and request.answer_length and generated >= request.answer_length:
        return {"type": "stop", "matched": eos_id}, text  # the model's EOS (not part of the text)
    if request.stops:
        best: tuple[int, str] | None = None
        for stop in request.stops:
            index = text.find(stop, max(0, previous_len - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            return {"type": "stop", "matched": best[1]}, text if sampling.no_stop_trim else text[: best[0]]
    return None, text
