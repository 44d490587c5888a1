"""Progress output of the generation loops: a tqdm bar on a terminal, plain stderr lines otherwise."""

from __future__ import annotations

import sys

__all__ = ["PrefillProgress", "Progress"]


class _Bar:
    """A tqdm bar (``desc``, ``total`` tokens) when enabled, tqdm is installed and stderr is a terminal
    (logs get plain lines instead); ``close()`` ends it."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar, self.enabled, self.total = None, enabled, total
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False)
            except ImportError:
                pass

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Progress(_Bar):
    """Generated tokens: the bar, or a stderr line every 32 tokens; ``__call__(i)`` after token ``i``."""

    def __init__(self, total: int, enabled: bool):
        super().__init__(total, enabled, "generate")

    def __call__(self, i: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (i + 1) % 32 == 0:
            print(f"generate: {i + 1} tokens", file=sys.stderr, flush=True)


class PrefillProgress(_Bar):
    """Prompt tokens prefilled: the bar, or a stderr line per run.

    ``__call__(done)`` takes the tokens prefilled so far (``CacheStepper.prefill``'s
    ``progress`` gives them run by run).
    """

    def __init__(self, total: int, enabled: bool):
        super().__init__(total, enabled, "prefill")
        self.done = 0

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
        elif self.enabled:
            print(f"generate: prefill {done}/{self.total} tokens", file=sys.stderr, flush=True)
        self.done = done
