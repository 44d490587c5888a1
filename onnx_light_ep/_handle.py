"""Lifetime of a Python object that owns one native arena handle (KVCache, KVPool, KVCheckpoint).

Subclasses set ``_kind`` (the class name used in messages), ``_copy_hint`` and implement
``_release(handle)``; they keep the handle in the slot ``_h`` (None once closed).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

__all__ = ["NativeHandle"]


class NativeHandle:
    __slots__ = ()
    _kind = "object"
    _copy_hint = ""
    _h: Optional[int]

    def _release(self, handle: int) -> None:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def _live(self, where: str) -> int:
        h = self._h
        if h is None:
            raise ValueError(f"{where}: the {self._kind[2:].lower() if self._kind.startswith('KV') else self._kind} "
                             f"is closed; expected an open {self._kind}")
        return h

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._h is None

    def close(self) -> None:
        """Release the handle. Idempotent; later use raises ``ValueError``."""
        h, self._h = self._h, None
        if h is not None:
            try:
                self._release(h)
            except ValueError:
                pass  # already gone: the state close() wants

    def __enter__(self):
        self._live(f"{self._kind}.__enter__")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_h", None) is None or sys is None or sys.is_finalizing():
            return
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self):
        raise TypeError(f"{self._kind} cannot be pickled or copied: it owns a process-local handle{self._copy_hint}")
