"""Registration of ``libonnx_light.so`` with ONNX Runtime.

The native library plays two roles for ORT: a custom-op library (domain
``ai.onnx_light``, registered per ``SessionOptions``) and a plugin execution
provider (``OnnxLightExecutionProvider``, registered once per process). ORT is
always given the path of the copy that ``onnx_light_ep._core`` has loaded, so
ORT and Python share one KV-cache arena.

``onnxruntime`` is imported lazily, inside the functions, so that importing
``onnx_light_ep`` (for example for the graph rewrite) does not need it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Mapping, Optional

from . import _core

EP_NAME = "OnnxLightExecutionProvider"
DOMAIN = "ai.onnx_light"

#: Oldest ONNX Runtime with the plugin-EP API (OrtApi version 23) the library
#: is compiled against.
MIN_ORT_VERSION = (1, 23)

# Session config key that marks a SessionOptions as already set up by
# register(); its value is the JSON of the provider options it was set up with.
_MARK_KEY = "onnx_light.registered"

# Process-wide: has the EP library been registered with ORT?
_ep_lock = threading.Lock()
_ep_registered = False


def get_library_path() -> str:
    """Absolute path of the native library ``libonnx_light.so`` loaded in this process.

    Read by the native module with ``dladdr`` (never guessed from a file name).
    ORT must be given exactly this file so that ORT and Python share one
    cache arena.

    Returns:
        str, an absolute file-system path.

    Raises:
        RuntimeError: the reported path does not exist.
    """
    path = os.path.abspath(os.fspath(_core.library_path()))
    if not os.path.isfile(path):
        raise RuntimeError(
            f"get_library_path: native library reported by onnx_light_ep._core "
            f"does not exist; expected a file, got {path!r}"
        )
    return path


def _import_ort():
    """Import onnxruntime and check it is new enough; returns the module."""
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise RuntimeError(
            "onnx_light_ep: onnxruntime is not installed; expected onnxruntime>=1.23"
        ) from e
    version = getattr(ort, "__version__", "")
    m = re.match(r"^(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) < MIN_ORT_VERSION:
        raise RuntimeError(
            f"onnx_light_ep: onnxruntime is too old; expected >= "
            f"{MIN_ORT_VERSION[0]}.{MIN_ORT_VERSION[1]}, got {version or 'unknown'}"
        )
    for name in ("register_execution_provider_library", "get_ep_devices"):
        if not hasattr(ort, name):
            raise RuntimeError(
                f"onnx_light_ep: onnxruntime {version} lacks {name}(); "
                f"expected onnxruntime>=1.23 with the plugin EP API"
            )
    return ort


def _ensure_ep_library(ort, path: str) -> None:
    """Register the plugin EP library with ORT once per process (thread-safe)."""
    global _ep_registered
    with _ep_lock:
        if _ep_registered:
            return
        try:
            ort.register_execution_provider_library(EP_NAME, path)
        except Exception as e:  # ORT raises its own Fail type
            # Someone (another copy of this module, or the user) registered it
            # under our name already: that is the state we want.
            if "already registered" not in str(e):
                raise RuntimeError(
                    f"register: onnxruntime could not load the execution provider "
                    f"library {path!r}: {e}"
                ) from e
        _ep_registered = True


def _ep_devices(ort) -> list:
    """The OrtEpDevice objects ORT offers for OnnxLightExecutionProvider."""
    return [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]


def _normalize_options(provider_options: Optional[Mapping[Any, Any]]) -> dict:
    if provider_options is None:
        return {}
    if not isinstance(provider_options, Mapping):
        raise ValueError(
            f"register: provider_options must be a dict of str to str; "
            f"got {type(provider_options).__name__}"
        )
    return {str(k): str(v) for k, v in provider_options.items()}


def _registered_options(sess_options) -> Optional[dict]:
    """Provider options recorded on ``sess_options`` by a previous register(), or None."""
    try:
        value = sess_options.get_session_config_entry(_MARK_KEY)
    except Exception:  # ORT raises when the key is absent
        return None
    try:
        recorded = json.loads(value)
    except ValueError:
        return {}
    return recorded if isinstance(recorded, dict) else {}


def register(sess_options=None, provider_options: Optional[Mapping[Any, Any]] = None):
    """Set up ``sess_options`` to run models on ``OnnxLightExecutionProvider``.

    1. registers the custom-op library (domain ``ai.onnx_light``) on
       ``sess_options`` (``register_custom_ops_library``), so models with
       ``CacheAttention``/``CacheExport`` load, also on plain CPU;
    2. registers the plugin EP library with ORT, once per process;
    3. selects the EP for its CPU ``OrtEpDevice``
       (``add_provider_for_devices``) with ``provider_options``.

    Args:
        sess_options: ``onnxruntime.SessionOptions`` to modify, or None for a
            new one.
        provider_options: mapping of option name to value; keys and values are
            converted with ``str()``. ``None`` means no options.

    Returns:
        The ``SessionOptions`` (the new one when ``None`` was given).

    Idempotent for one ``SessionOptions``: a second call does nothing, and
    raises ``ValueError`` only if it passes ``provider_options`` different from
    the first call's.

    Raises:
        RuntimeError: onnxruntime older than 1.23, the library cannot be
            loaded, or ORT offers no device for the EP.
        ValueError: ``provider_options`` is not a mapping, or conflicts with
            the options this ``SessionOptions`` was already set up with.

    Thread safety: the process-wide EP registration is locked; one
    ``SessionOptions`` must not be registered from two threads at once.
    """
    ort = _import_ort()
    options = _normalize_options(provider_options)
    if sess_options is None:
        sess_options = ort.SessionOptions()

    recorded = _registered_options(sess_options)
    if recorded is not None:
        if provider_options is not None and options != recorded:
            raise ValueError(
                f"register: sess_options already uses {EP_NAME} with provider_options "
                f"{recorded}; got {options}. Use a new SessionOptions."
            )
        return sess_options

    path = get_library_path()
    _ensure_ep_library(ort, path)
    devices = _ep_devices(ort)
    if not devices:
        raise RuntimeError(
            f"register: onnxruntime {ort.__version__} offers no OrtEpDevice for "
            f"{EP_NAME} after loading {path!r}; expected one CPU device"
        )

    sess_options.register_custom_ops_library(path)
    sess_options.add_provider_for_devices(devices, options)
    sess_options.add_session_config_entry(_MARK_KEY, json.dumps(options, sort_keys=True))
    return sess_options


_session_class = None


def _translate(error: BaseException) -> Optional[BaseException]:
    """The arena error class an ORT error stands for (its message names the kind), or None."""
    from .errors import KVCacheBusyError, KVCacheMemoryError

    text = str(error)
    for name, cls in (("KVCacheMemoryError:", KVCacheMemoryError), ("KVCacheBusyError:", KVCacheBusyError)):
        if name in text:
            return cls(text[text.index(name) + len(name):].strip())
    return None


def _guarded(run):
    """Wraps an ``InferenceSession.run*`` method in a deferred cache run (see ``InferenceSession``)."""

    def method(self, *args, **kwargs):
        _core.run_begin(True)
        ok = False
        diagnoses = []
        try:
            result = run(self, *args, **kwargs)
            ok = True
        except Exception as e:
            translated = _translate(e)
            if translated is not None:
                raise translated from e
            raise
        finally:  # also for KeyboardInterrupt and other BaseExceptions: the run always ends here
            diagnoses = _core.run_end(ok)
        if diagnoses:
            raise ValueError("InferenceSession.run: " + "; ".join(diagnoses))
        return result

    method.__name__ = run.__name__
    method.__doc__ = run.__doc__
    return method


def _session_type(ort):
    """``onnxruntime.InferenceSession`` whose runs commit cache steps only when they succeed."""
    global _session_class
    if _session_class is None:
        base = ort.InferenceSession
        attrs = {"__doc__": "An onnxruntime.InferenceSession on OnnxLightExecutionProvider whose run, "
                            "run_with_iobinding and run_with_ort_values commit KVCache steps only when "
                            "the run returns normally (onnx_light_ep.InferenceSession)."}
        for name in ("run", "run_with_iobinding", "run_with_ort_values"):
            if hasattr(base, name):
                attrs[name] = _guarded(getattr(base, name))
        _session_class = type("InferenceSession", (base,), attrs)
    return _session_class


def InferenceSession(model, sess_options=None, provider_options: Optional[Mapping[Any, Any]] = None):
    """An ``onnxruntime.InferenceSession`` that runs on ``OnnxLightExecutionProvider``.

    Args:
        model: path (str or ``os.PathLike``), serialized model bytes, or an
            ``onnx.ModelProto`` (serialized here).
        sess_options: ``onnxruntime.SessionOptions`` or None; passed through
            :func:`register`.
        provider_options: see :func:`register`.

    Returns:
        a subclass of ``onnxruntime.InferenceSession`` whose first provider is
        ``OnnxLightExecutionProvider`` (nodes it does not claim run on CPU).
        Its ``run``, ``run_with_iobinding`` and ``run_with_ort_values`` are
        transactional for every ``KVCache`` the run appends to: the run's rows
        become visible only if the call returns normally; if anything raises
        (any node, a cancellation through ``RunOptions.terminate``, an output
        error), every cache is exactly as before the call. A run that succeeds
        but appended only some of a cache's layers (a model with fewer
        attention layers than the cache) raises ``ValueError`` and appends
        nothing. ORT errors that carry an arena error kind are re-raised as
        ``KVCacheMemoryError`` / ``KVCacheBusyError`` (the ORT error chained).
        ``run_async`` has no such guarantee (it completes on another thread).

    Raises:
        RuntimeError: as :func:`register`, or when ORT did not put the EP first
            in ``session.get_providers()`` (ORT silently falls back to the CPU
            EP when the EP fails to start; its reason is in ORT's log).
        Whatever ``onnxruntime.InferenceSession`` raises for a bad model, or
        when the EP's ``CreateEp`` fails with an ORT error (ORT 1.32 raises
        its ``Fail`` there instead of falling back).
    """
    ort = _import_ort()
    sess_options = register(sess_options, provider_options)
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    session = _session_type(ort)(model, sess_options)
    providers = session.get_providers()
    if not providers or providers[0] != EP_NAME:
        raise RuntimeError(
            f"InferenceSession: expected {EP_NAME} as the first provider, got "
            f"{providers}; ORT fell back to CPU because the EP failed to start "
            f"(see the ORT log above for the reason)"
        )
    return session
