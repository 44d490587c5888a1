"""Long prompts for generation benchmarks and tests: a shared system prompt of a chosen token length.

``catalogue_system_prompt(tokenizer, num_tokens)`` is the text of a made-up
parts catalogue (seeded, so every run gets the same text), cut at the first
line where it reaches ``num_tokens`` tokens; ``catalogue_questions`` asks about
entries of it. Used where requests share a long system prompt and differ in
the user turn (prefix caching).
"""

from __future__ import annotations

from typing import List

import numpy as np

__all__ = ["catalogue_questions", "catalogue_system_prompt"]

_ADJ = ("steel", "brass", "plastic", "copper", "rubber", "carbon", "ceramic", "glass", "nylon", "oak")
_NOUN = ("bolt", "hinge", "valve", "gasket", "spring", "bracket", "washer", "pulley", "clamp", "bearing")
_HEAD = ("You are the help desk of a parts warehouse. Answer questions about the catalogue below "
         "briefly and only from it.\n\nCatalogue:\n")


def _line(i: int, rng: np.random.Generator) -> str:
    adj, noun = _ADJ[rng.integers(len(_ADJ))], _NOUN[rng.integers(len(_NOUN))]
    return (f"Part {i:04d}: {adj} {noun}, shelf {chr(65 + rng.integers(26))}{rng.integers(1, 40)}, "
            f"{rng.integers(0, 500)} in stock, code {rng.integers(10**5, 10**6)}.\n")


def catalogue_system_prompt(tokenizer, num_tokens: int = 2048, seed: int = 0) -> str:
    """A system prompt of at least ``num_tokens`` tokens (by ``tokenizer.encode``), ending after a whole line.

    Args:
        tokenizer: anything with ``encode(text) -> list of ids`` (``onnx_light_ep._text.TextTokenizer``).
        num_tokens: int >= 1, the least length in tokens (the text overshoots by less than one line, ~25).
        seed: the catalogue's RNG seed.

    Raises:
        ValueError: ``num_tokens`` < 1.
    """
    if num_tokens < 1:
        raise ValueError(f"catalogue_system_prompt: num_tokens; expected >= 1, got {num_tokens}")
    rng = np.random.default_rng(seed)
    lines = [_HEAD]
    approx = len(tokenizer.encode(_HEAD))
    i = 0
    while True:
        line = _line(i, rng)
        lines.append(line)
        i += 1
        approx += len(tokenizer.encode(line))
        if approx >= num_tokens and len(tokenizer.encode("".join(lines))) >= num_tokens:
            return "".join(lines)


def catalogue_questions(n: int, seed: int = 1) -> List[str]:
    """``n`` different short questions about parts of the catalogue (the first 40 parts)."""
    kinds = ("Which shelf holds part {:04d}?", "How many of part {:04d} are in stock?",
             "What is the code of part {:04d}?", "What is part {:04d} made of?")
    rng = np.random.default_rng(seed)
    out: List[str] = []
    while len(out) < n:
        q = kinds[len(out) % len(kinds)].format(int(rng.integers(40)))
        if q not in out:
            out.append(q)
    return out
