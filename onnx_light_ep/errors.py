"""Exception classes of the KV-cache arena.

- ``KVCacheError(RuntimeError)``: base of the arena's own errors.
- ``KVCacheMemoryError(KVCacheError, MemoryError)``: a cache's or a pool's
  ``memory_limit_bytes`` would be exceeded; the operation changed nothing. The
  message names the limit, what the operation needs and what is in use.
- ``KVCacheBusyError(KVCacheError)``: another run owns the cache (a concurrent
  run, or a method racing a run); the message names the competing run.

Bad arguments raise ``ValueError``. Inside ``session.run`` the ORT error text
starts with ``KVCacheMemoryError:`` / ``KVCacheBusyError:``;
``onnx_light_ep.InferenceSession`` re-raises those as these classes.
"""

__all__ = ["KVCacheError", "KVCacheMemoryError", "KVCacheBusyError"]


class KVCacheError(RuntimeError):
    """Base class of the KV-cache arena's errors (not raised itself)."""


class KVCacheMemoryError(KVCacheError, MemoryError):
    """A cache quota or pool budget (``memory_limit_bytes``) would be exceeded; nothing changed."""


class KVCacheBusyError(KVCacheError):
    """The cache is owned by another run right now; nothing changed."""
