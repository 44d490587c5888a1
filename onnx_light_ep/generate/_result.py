"""What a generation loop returns, and the error that carries a partial result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["GenerateError", "GenerateResult"]


@dataclass
class GenerateResult:
    """Output of :func:`generate` (times in seconds; ``tokens_per_second`` counts decode steps only).

    ``cached_tokens``: prompt positions reused from a ``PrefixCache`` instead of
    prefilled (0 without one); ``prefill_seconds`` then covers the lookup, the
    fork and the prefill of the rest (the time to the first token's logits).
    """

    token_ids: List[List[int]]
    texts: Optional[List[str]]
    prompt_lengths: List[int]
    finished: List[bool]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    providers: List[str] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def text(self) -> Optional[str]:
        return self.texts[0] if self.texts else None

    @property
    def tokens_per_second(self) -> float:
        n = self.decode_steps * len(self.token_ids)
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class GenerateError(RuntimeError):
    """A run failed after generation started: ``partial`` is the :class:`GenerateResult` of the
    tokens generated before the failure (``__cause__`` is the original error)."""

    def __init__(self, message: str, partial: "GenerateResult"):
        super().__init__(message)
        self.partial = partial


