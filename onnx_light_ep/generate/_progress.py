"""Progress output of the generation loops."""

from __future__ import annotations

import sys

__all__ = ["PrefillProgress", "Progress"]


class Progress:
    """tqdm bar (if installed) or a stderr line every 32 tokens; ``close()`` ends it."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.enabled = None, enabled
        if enabled and sys.stderr.isatty():   # a bar only on a terminal; logs get plain lines
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="generate", unit="tok", leave=False)
            except ImportError:
                pass

    def __call__(self, i: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (i + 1) % 32 == 0:
            print(f"generate: {i + 1} tokens", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PrefillProgress:
    """Prompt tokens prefilled: a tqdm bar (if installed) or a stderr line per run; ``close()`` ends it.

    ``__call__(done)`` takes the tokens prefilled so far (``CacheStepper.prefill``'s
    ``progress`` gives them run by run).
    """

    def __init__(self, total: int, enabled: bool):
        self.bar, self.enabled, self.total, self.done = None, enabled, total, 0
        if enabled and sys.stderr.isatty():   # a bar only on a terminal; logs get plain lines
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="prefill", unit="tok", leave=False)
            except ImportError:
                pass

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
        elif self.enabled:
            print(f"generate: prefill {done}/{self.total} tokens", file=sys.stderr, flush=True)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
