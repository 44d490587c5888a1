"""What a generation loop returns, and the error that carries a partial result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["GenerateError", "GenerateResult"]


@dataclass
class GenerateResult:
    """Output of :func:`generate` (times in seconds; ``tokens_per_second`` counts decode steps only,
    ``decode_rows`` tokens per step under beam search, else one per returned row).

    Beam search (``num_beams >= 2``) fills the fields after ``providers``:
    ``token_ids``/``texts`` are then the ``num_return_sequences`` best
    hypotheses of each prompt, best first (without the EOS token; ``finished``
    says which ended on one), ``sequences_scores`` their scores (transformers'
    ``sequences_scores``: sum of log-probabilities, EOS included, divided by
    generated_length ** length_penalty), ``decode_rows`` the rows of each decode
    run (``num_beams``), ``bytes_copied_per_step`` the K/V bytes the cache copied
    in each decode run (delta of ``KVCache.stats()["bytes_copied"]``: tail pages
    copied on write after a reorder) and ``committed_bytes_per_step`` the cache's
    committed page bytes after it. The other loops leave the defaults.

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
    num_beams: int = 1
    decode_rows: Optional[int] = None
    sequences_scores: Optional[List[float]] = None
    bytes_copied_per_step: Optional[List[int]] = None
    committed_bytes_per_step: Optional[List[int]] = None
    # -- speculative decoding (generate(speculative=...)): drafts verified / accepted over every row, and the
    # tokens the decode runs gave (a verification run gives 1 + its accepted drafts; None: one per row and step).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_tokens: Optional[int] = None

    @property
    def text(self) -> Optional[str]:
        return self.texts[0] if self.texts else None

    @property
    def tokens_per_second(self) -> float:
        if self.decode_tokens is not None:
            n = self.decode_tokens
        else:
            n = self.decode_steps * (self.decode_rows if self.decode_rows is not None else len(self.token_ids))
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Speculative decoding: ``accepted_tokens / draft_tokens`` (NaN when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")


class GenerateError(RuntimeError):
    """A run failed after generation started: ``partial`` is the :class:`GenerateResult` of the
    tokens generated before the failure (``__cause__`` is the original error)."""

    def __init__(self, message: str, partial: "GenerateResult"):
        super().__init__(message)
        self.partial = partial


