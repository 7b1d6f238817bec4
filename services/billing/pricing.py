"""What a request costs, for budget reservations. One flat price per token kind until billing's
versioned price book (issue 6) replaces it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    input_per_mtok: float
    output_per_mtok: float
    cached_input_per_mtok: float

    def cost(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> float:
        uncached = max(0, input_tokens - cached_tokens)
        return (uncached * self.input_per_mtok + cached_tokens * self.cached_input_per_mtok
                + output_tokens * self.output_per_mtok) / 1e6
