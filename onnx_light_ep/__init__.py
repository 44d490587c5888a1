"""onnx-light-ep: a persistent KV cache for decoder LLMs on ONNX Runtime (CPU).

Public names:

- ``EP_NAME``: ``"OnnxLightExecutionProvider"``, the plugin execution provider.
- ``DOMAIN``: ``"ai.onnx_light"`` (opset 1), the custom-op domain
  (``CacheAttention``, ``CacheExport``).
- ``get_library_path()``: path of the loaded native library ``libonnx_light.so``.
- ``register(sess_options=None, provider_options=None)``: set up an
  ``onnxruntime.SessionOptions`` for the ops and the EP.
- ``InferenceSession(model, sess_options=None, provider_options=None)``: an
  ``onnxruntime.InferenceSession`` that is guaranteed to run on the EP.
- ``KVPool``: a page pool and memory budget shared by caches; ``KVCheckpoint``:
  a retained snapshot (``KVCache.checkpoint()``).
- ``KVCacheError``, ``KVCacheMemoryError``, ``KVCacheBusyError``: the arena's
  error classes.
- ``KVCache``: the cache object; feed ``KVCache.handle`` to the model
  (``KVCache.for_model(path_or_session, batch_size, max_sequence_length)``
  sizes one for a converted model).
- ``convert(input_path, output_path, **options)``: rewrite an exported decoder
  into a cache-aware model (``onnx_light_ep.rewrite``); returns a report.

See docs/API.md for the full contract. ``onnxruntime`` is imported only when
``register``/``InferenceSession`` are called.
"""

import importlib.machinery as _machinery
import os as _os
import sys as _sys


def _has_core(directory):
    try:
        names = _os.listdir(directory)
    except OSError:
        return False
    suffixes = tuple(_machinery.EXTENSION_SUFFIXES)
    return any(n.startswith("_core.") and n.endswith(suffixes) for n in names)


def _installed_copy_elsewhere():
    """Directory of another ``onnx_light_ep`` on ``sys.path`` that has ``_core``."""
    here = _os.path.realpath(_os.path.dirname(__file__))
    for entry in _sys.path:
        if not isinstance(entry, str):
            continue
        candidate = _os.path.join(entry or _os.curdir, __name__)
        if _os.path.realpath(candidate) == here:
            continue
        if _os.path.isfile(_os.path.join(candidate, "__init__.py")) and _has_core(candidate):
            return _os.path.abspath(candidate)
    return None


if not _has_core(_os.path.dirname(__file__)):
    # This is a source checkout without a build (for example `python -m pytest`
    # run in the repository root puts the checkout first on sys.path). Load the
    # installed package in its place, so that what runs is what
    # `pip install .` built, exactly as if the checkout were not on sys.path.
    _other = _installed_copy_elsewhere()
    if _other is None:
        raise ImportError(
            "onnx_light_ep: the compiled module onnx_light_ep._core is missing from "
            f"{_os.path.dirname(_os.path.abspath(__file__))} and no installed copy was "
            "found on sys.path; install the package first: python -m pip install ."
        )
    import importlib.util as _util

    _spec = _util.spec_from_file_location(
        __name__, _os.path.join(_other, "__init__.py"), submodule_search_locations=[_other]
    )
    _module = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _module
    try:
        _spec.loader.exec_module(_module)
    except BaseException:
        del _sys.modules[__name__]
        raise
else:
    from ._registration import DOMAIN, EP_NAME, InferenceSession, get_library_path, register
    from .cache import DEFAULT_PAGE_BYTES, KVCache, default_page_tokens
    from .errors import KVCacheBusyError, KVCacheError, KVCacheMemoryError
    from .pool import KVCheckpoint, KVPool

    __version__ = "0.2.0"

    def convert(input_path, output_path, *, keep_present=(), sliding_window=None, cache_input="kv_cache",
                check=True, stage=None, fuse_gqa=True, logits_to_keep=False):
        """Rewrite an exported decoder model to use a ``KVCache`` (``onnx_light_ep.rewrite.convert``,
        imported on first use so that ``import onnx_light_ep`` does not load onnx).

        Args: input_path / output_path (external data goes to ``<output_path>.data``);
        keep_present: present output names to keep (produced by ``CacheExport``);
        sliding_window: window for attentions whose graph carries none (None = none);
        cache_input: name of the int64 ``[1]`` cache-handle input to add;
        check: run ``onnx.checker`` on the result;
        stage: ``"prefill"``/``"decode"`` for one graph of a prefill/decode pair (transformers'
        exporter); a folder holding ``prefill.onnx`` and ``decode.onnx`` as ``input_path``
        converts both into the folder ``output_path``;
        fuse_gqa: one ``CacheAttention`` per GroupQueryAttention taking its packed QKV and rotary
        (True, default) or QKV Split + RotaryEmbedding nodes in front of it (False);
        logits_to_keep: add the required int64 scalar input ``logits_to_keep`` that limits the LM
        head to the last N positions of a run (0 = all; off by default).

        Returns an ``onnx_light_ep.rewrite.ConvertReport`` (a ``PairReport`` for a folder); raises
        ``onnx_light_ep.rewrite.ConvertError`` when nothing can be converted or an option is
        bad, ``FileNotFoundError`` when ``input_path`` does not exist.
        """
        from .rewrite import convert as _convert

        return _convert(input_path, output_path, keep_present=keep_present, sliding_window=sliding_window,
                        cache_input=cache_input, check=check, stage=stage, fuse_gqa=fuse_gqa,
                        logits_to_keep=logits_to_keep)

    __all__ = [
        "DEFAULT_PAGE_BYTES",
        "default_page_tokens",
        "DOMAIN",
        "EP_NAME",
        "InferenceSession",
        "KVCache",
        "KVCacheBusyError",
        "KVCacheError",
        "KVCacheMemoryError",
        "KVCheckpoint",
        "KVPool",
        "convert",
        "get_library_path",
        "register",
    ]
