"""The decode-step candidates the benchmark interleaves (see ``decode.py``).

Each candidate owns its sessions and its K/V state, is built from one shared
:class:`StepData` (same past contents and the same new-token inputs for all),
and exposes ``step()``: one decode token through all layers, the only call
that is timed. State advances by one token per ``step()``.

Keys (stable, used in the JSON):

- ``ort_attention_past``: ONNX ``Attention`` (opset 23) with tensor
  past/present on ORT's CPU EP; every step's ``present_*`` OrtValues are
  bound as the next step's ``past_*`` (no numpy round trip).
- ``ort_gqa_shared``: ``com.microsoft.GroupQueryAttention`` with past and
  present bound to the same preallocated OrtValue of capacity ``max_len``
  (onnxruntime-genai's shared buffer): the equivalent-contract comparator.
- ``ort_tensor_scatter``: opset-24 ``TensorScatter`` into a static cache bound
  in place (output OrtValue = input OrtValue, so ORT's kernel skips its copy)
  + ``Attention`` with ``nonpad_kv_seqlen``.
- ``ep_attention_past``: the ``ort_attention_past`` model through
  ``onnx_light_ep.InferenceSession`` (tensor compatibility mode).
- ``ep_kvcache``: ``CacheAttention`` with a ``KVCache`` on the EP.
- ``limit``: ``_core.stream_read`` over exactly the K+V bytes a step reads
  (the physical limit), split over ``threads`` Python threads (the native
  call releases the GIL).

Thread safety: none; one benchmark thread drives all candidates.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import ml_dtypes
import numpy as np
from onnx import TensorProto

from . import models
from .. import _core
from .._registration import EP_NAME, InferenceSession, _import_ort

CPU_EP = "CPUExecutionProvider"
BF16 = np.dtype(ml_dtypes.bfloat16)
#: Settings of every benchmark session (see ``configure_sessions``).
_SESSION_SETTINGS = {"allow_spinning": False}
NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


@dataclass
class StepData:
    """Inputs shared by every candidate of one configuration.

    ``past_keys[l]``/``past_values[l]``: BNSH ``[B, Hkv, L, D]`` C-contiguous,
    one distinct array per layer (they are also the ``limit`` candidate's
    buffers). ``query``: ``[B, 1, Hq*D]``; ``keys[l]``/``values[l]``:
    ``[B, 1, Hkv*D]`` (the new token, the same every step). ``capacity``:
    rows of the static buffers (``L`` + every step the run will take).
    """

    q_num_heads: int
    kv_num_heads: int
    head_dim: int
    batch_size: int
    context_length: int
    dtype: str
    num_layers: int
    capacity: int
    past_keys: List[np.ndarray]
    past_values: List[np.ndarray]
    query: np.ndarray
    keys: List[np.ndarray]
    values: List[np.ndarray]

    @property
    def read_bytes(self) -> int:
        """K+V bytes at context ``L`` over all layers (what one step must read)."""
        return sum(a.nbytes for a in self.past_keys) + sum(a.nbytes for a in self.past_values)

    @property
    def append_bytes(self) -> int:
        """K+V bytes of one new token over all layers."""
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)


def make_step_data(*, q_num_heads, kv_num_heads, head_dim, batch_size, context_length, dtype,
                   num_layers, capacity, seed=0) -> StepData:
    """Random (standard normal) inputs; big buffers are tiled from one random block (fast)."""
    rng = np.random.default_rng(seed)
    np_dtype = NP_DTYPES[dtype]
    block = rng.standard_normal((1 << 20) + 4099).astype(np.float32).astype(np_dtype)

    def filled(shape, offset):
        n = int(np.prod(shape))
        a = np.empty(n, np_dtype)
        m = min(n, block.size - offset)
        a[:m] = block[offset:offset + m]
        while m < n:  # doubling copies: memcpy speed
            k = min(m, n - m)
            a[m:m + k] = a[:k]
            m += k
        return a.reshape(shape)

    past_shape = (batch_size, kv_num_heads, context_length, head_dim)
    row = (batch_size, 1, kv_num_heads * head_dim)
    return StepData(
        q_num_heads, kv_num_heads, head_dim, batch_size, context_length, dtype, num_layers, capacity,
        past_keys=[filled(past_shape, 97 * l + 1) for l in range(num_layers)],
        past_values=[filled(past_shape, 89 * l + 2) for l in range(num_layers)],
        query=filled((batch_size, 1, q_num_heads * head_dim), 5),
        keys=[filled(row, 13 * l + 7) for l in range(num_layers)],
        values=[filled(row, 17 * l + 11) for l in range(num_layers)])


# -- OrtValue helpers ---------------------------------------------------------

def ortvalue(arr: np.ndarray):
    """OrtValue sharing ``arr``'s memory (bfloat16 passed as its uint16 bits)."""
    ort = _import_ort()
    arr = np.ascontiguousarray(arr)
    if arr.dtype == BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr.view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(arr)


def to_float32(ov) -> np.ndarray:
    """Copy of a CPU OrtValue as float32 numpy (bfloat16 read through its bits)."""
    if ov.data_type() == "tensor(bfloat16)":
        shape = tuple(ov.shape())
        n = int(np.prod(shape))
        buf = (ctypes.c_uint16 * n).from_address(ov.data_ptr())
        return np.frombuffer(buf, dtype=np.uint16).copy().view(BF16).reshape(shape).astype(np.float32)
    return np.array(ov.numpy(), dtype=np.float32, copy=True)  # numpy() may alias ORT memory


def configure_sessions(allow_spinning: bool) -> None:
    """Process-wide settings for the sessions built after this call.

    Spinning is off by default: interleaved sessions would otherwise keep
    spinning workers on the cores the next candidate runs on. Each session keeps
    ORT's default CPU arena (a shared env arena with kSameAsRequested grows
    without bound here, because every step's ``present`` is one row larger).
    """
    _SESSION_SETTINGS["allow_spinning"] = bool(allow_spinning)


def session_options(threads: int, profile_dir: Optional[str] = None, allow_spinning: Optional[bool] = None):
    """Sequential execution, ``intra_op_num_threads = threads``, spinning per
    :func:`configure_sessions` (or ``allow_spinning`` when given), warnings off, profiling into
    ``profile_dir`` if given."""
    ort = _import_ort()
    so = ort.SessionOptions()
    so.intra_op_num_threads = int(threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    spin = _SESSION_SETTINGS["allow_spinning"] if allow_spinning is None else allow_spinning
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if profile_dir is not None:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(profile_dir, "bench")
    return so


FUSED = "fused by " + EP_NAME
"""Key of node_providers for the EP's nodes: it runs each node it claims as a fused graph that the
profile names ``OnnxLightExecutionProvider_<hash>_<n>``, without the op type."""


def node_providers(profile_path: str) -> Dict[str, List[str]]:
    """{op_name: sorted providers} of the node events in an ORT profile trace (EP nodes under FUSED)."""
    with open(profile_path) as f:
        events = json.load(f)
    found: Dict[str, set] = {}
    for ev in events:
        args = ev.get("args") or {}
        if ev.get("cat") == "Node" and "op_name" in args and "provider" in args:
            name = FUSED if args["op_name"].startswith(EP_NAME + "_") else args["op_name"]
            found.setdefault(name, set()).add(args["provider"])
    return {k: sorted(v) for k, v in sorted(found.items())}


def claimed_by_ep(providers: Dict[str, List[str]], op_types) -> bool:
    """True if no node of ``op_types`` ran outside the EP and some node ran on the EP."""
    on_ep = any(EP_NAME in p for p in providers.values())
    elsewhere = any(p != EP_NAME for op in op_types for p in providers.get(op, []))
    return on_ep and not elsewhere


def _make_session(model, threads, on_ep, profile_dir=None):
    ort = _import_ort()
    so = session_options(threads, profile_dir)
    data = model.SerializeToString()
    if on_ep:
        return InferenceSession(data, so)
    return ort.InferenceSession(data, so, providers=[CPU_EP])


# -- candidates ---------------------------------------------------------------

class Candidate:
    """Base class. One object holds the K/V state and one session per thread count.

    ``step(threads)``: one decode token through all layers on the session with
    ``intra_op_num_threads == threads`` (the timed call; the state is shared, so
    steps at different thread counts continue the same sequence).
    ``output()``: the last step's ``Y`` as float32 ``[B, Hq*D]`` (a copy).
    ``providers``: {op_name: providers} from one profiled run (EP candidates).
    """

    key = ""
    providers: Dict[str, List[str]] = {}

    def step(self, threads: int) -> None:
        raise NotImplementedError

    def output(self) -> Optional[np.ndarray]:
        return None

    def cache_stats(self) -> Optional[Dict[str, int]]:
        return None

    def close(self) -> None:
        pass


def _y_of(binding) -> np.ndarray:
    y = binding.get_outputs()[0]
    return to_float32(y).reshape(y.shape()[0], -1)


class TensorPast(Candidate):
    """``ort_attention_past`` / ``ep_attention_past``: present OrtValues become the next past."""

    def __init__(self, key: str, data: StepData, threads: Sequence[int], on_ep: bool):
        self.key = key
        self.num_layers = data.num_layers
        model = models.attention_past_model(data.num_layers, data.q_num_heads, data.kv_num_heads,
                                            data.head_dim, data.dtype)
        self.inputs = {"query": ortvalue(data.query)}
        for l in range(data.num_layers):
            self.inputs[f"key_{l}"] = ortvalue(data.keys[l])
            self.inputs[f"value_{l}"] = ortvalue(data.values[l])
            self.inputs[f"past_key_{l}"] = ortvalue(data.past_keys[l])
            self.inputs[f"past_value_{l}"] = ortvalue(data.past_values[l])
        self.out_names = ["Y"] + [f"present_{kv}_{l}" for l in range(data.num_layers)
                                  for kv in ("key", "value")]
        if on_ep:
            self.providers = self._profile(model, threads[0])
            if not claimed_by_ep(self.providers, ("Attention",)):
                self.sessions = {}
                return
        self.sessions = {t: _make_session(model, t, on_ep) for t in threads}
        self.bindings = {}
        for t, sess in self.sessions.items():
            b = self.bindings[t] = sess.io_binding()
            for name, ov in self.inputs.items():
                b.bind_ortvalue_input(name, ov)
        self._y = None

    def _profile(self, model, threads) -> Dict[str, List[str]]:
        """Which provider ran each op, from one profiled run on the real inputs (state untouched)."""
        with tempfile.TemporaryDirectory() as tmp:
            sess = _make_session(model, threads, True, tmp)
            sess.run_with_ort_values(["Y"], self.inputs)
            return node_providers(sess.end_profiling())

    def step(self, threads: int) -> None:
        b = self.bindings[threads]
        for l in range(self.num_layers):  # this step's past = the previous step's present
            b.bind_ortvalue_input(f"past_key_{l}", self.inputs[f"past_key_{l}"])
            b.bind_ortvalue_input(f"past_value_{l}", self.inputs[f"past_value_{l}"])
        b.clear_binding_outputs()
        for name in self.out_names:
            b.bind_output(name)
        self.sessions[threads].run_with_iobinding(b)
        outs = b.get_outputs()
        for l in range(self.num_layers):
            self.inputs[f"past_key_{l}"] = outs[1 + 2 * l]
            self.inputs[f"past_value_{l}"] = outs[2 + 2 * l]
        self._y = outs[0]

    def output(self):
        return None if self._y is None else to_float32(self._y).reshape(self._y.shape()[0], -1)

    def close(self) -> None:
        self.bindings = self.sessions = self.inputs = self._y = None


class StaticBuffer(Candidate):
    """``ort_gqa_shared`` / ``ort_tensor_scatter``: past and present bound to one OrtValue."""

    def __init__(self, key: str, data: StepData, threads: Sequence[int]):
        self.key = key
        self.past_length = data.context_length
        B, H, L, D, M = (data.batch_size, data.kv_num_heads, data.context_length, data.head_dim,
                         data.capacity)
        np_dtype = NP_DTYPES[data.dtype]
        gqa = key == "ort_gqa_shared"
        build = models.gqa_shared_buffer_model if gqa else models.tensor_scatter_model
        model = build(data.num_layers, data.q_num_heads, data.kv_num_heads, data.head_dim, data.dtype)
        # Inputs/outputs as (name, OrtValue, is_output); Y is bound first so get_outputs()[0] is Y.
        binds = [("query", ortvalue(data.query if gqa else data.query.reshape(B, -1, 1, D)), False)]
        self._keep = []  # numpy buffers behind the bound OrtValues
        for l in range(data.num_layers):
            for kv, past, new in (("key", data.past_keys[l], data.keys[l]),
                                  ("value", data.past_values[l], data.values[l])):
                buf = np.empty((B, H, M, D), np_dtype)
                buf[:, :, :L] = past
                buf[:, :, L:] = 0
                ov = ortvalue(buf)
                self._keep.append(buf)
                binds += [(f"past_{kv}_{l}", ov, False), (f"present_{kv}_{l}", ov, True),
                          (f"{kv}_{l}", ortvalue(new if gqa else new.reshape(B, H, 1, D)), False)]
        if gqa:
            self.lengths = np.zeros(B, np.int32)      # seqlens_k = total - 1
            self.total = np.zeros((), np.int32)       # total_sequence_length
            names = ("seqlens_k", "total_sequence_length")
        else:
            self.lengths = np.zeros(B, np.int64)      # write_indices = past length
            self.total = np.zeros(B, np.int64)        # nonpad_kv_seqlen = past length + 1
            names = ("write_indices", "nonpad_kv_seqlen")
        self.len_ov, self.total_ov = ortvalue(self.lengths), ortvalue(self.total)
        binds += [(names[0], self.len_ov, False), (names[1], self.total_ov, False)]
        self.sessions = {t: _make_session(model, t, False) for t in threads}
        self.bindings = {}
        for t, sess in self.sessions.items():
            b = self.bindings[t] = sess.io_binding()
            b.bind_output("Y")
            for name, ov, is_out in binds:
                (b.bind_ortvalue_output if is_out else b.bind_ortvalue_input)(name, ov)
        self._capacity = M
        self._last = None

    def step(self, threads: int) -> None:
        p = self.past_length
        if p + 1 > self._capacity:
            raise RuntimeError(f"{self.key}: static buffer full; expected <= {self._capacity} rows")
        self.lengths.fill(p)
        self.total.fill(p + 1)
        self.len_ov.update_inplace(self.lengths)
        self.total_ov.update_inplace(self.total)
        self.sessions[threads].run_with_iobinding(self.bindings[threads])
        self.past_length = p + 1
        self._last = threads

    def output(self):
        return None if self._last is None else _y_of(self.bindings[self._last])

    def close(self) -> None:
        self.bindings = self.sessions = self.len_ov = self.total_ov = None
        self._keep = []


EP_PAGE_TOKENS = None  # page size of ep_kvcache (run_bench(page_tokens=...)); None = library default


class EpKVCache(Candidate):
    """``ep_kvcache``: ``CacheAttention`` on the EP, cache pre-filled with ``KVCache.from_past``
    on pages of the default size (``default_page_tokens(head_dim, dtype)``)."""

    key = "ep_kvcache"

    def page_tokens(self, data: StepData):
        return EP_PAGE_TOKENS

    def __init__(self, data: StepData, threads: Sequence[int]):
        from ..cache import KVCache

        self.cache = KVCache.from_past(data.past_keys, data.past_values,
                                       max_sequence_length=data.capacity, page_tokens=self.page_tokens(data))
        model = models.cache_attention_model(data.num_layers, data.q_num_heads, data.kv_num_heads,
                                             data.head_dim, data.dtype)
        inputs = {"query": ortvalue(data.query), "kv_cache": ortvalue(self.cache.handle)}
        for l in range(data.num_layers):
            inputs[f"key_{l}"] = ortvalue(data.keys[l])
            inputs[f"value_{l}"] = ortvalue(data.values[l])
        with tempfile.TemporaryDirectory() as tmp:
            sess = _make_session(model, threads[0], True, tmp)
            sess.run_with_ort_values(["Y"], inputs)
            self.providers = node_providers(sess.end_profiling())
        self.cache.truncate(data.context_length)  # undo the profiled step (O(1), no copy)
        self.sessions = {t: _make_session(model, t, True) for t in threads}
        self.bindings = {}
        for t, sess in self.sessions.items():
            b = self.bindings[t] = sess.io_binding()
            for name, ov in inputs.items():
                b.bind_ortvalue_input(name, ov)
            b.bind_output("Y")
        self._inputs = inputs
        self._last = None

    def step(self, threads: int) -> None:
        self.sessions[threads].run_with_iobinding(self.bindings[threads])
        self._last = threads

    def output(self):
        return None if self._last is None else _y_of(self.bindings[self._last])

    def cache_stats(self):
        return self.cache.stats()

    def close(self) -> None:
        self.bindings = self.sessions = self._inputs = None
        self.cache.close()


class EpKVCacheBlock(EpKVCache):
    """``ep_kvcache_block``: the same bytes in one page per (layer, sequence, kv head), i.e. one
    contiguous block (the storage before pages), for the paged-vs-block cost in the same run."""

    key = "ep_kvcache_block"

    def page_tokens(self, data: StepData):
        return -(-data.capacity // 32) * 32


class EpKVCacheSmallPages(EpKVCache):
    """``ep_kvcache_4k``: ``ep_kvcache`` on slabs without huge pages (4 KiB pages, MADV_NOHUGEPAGE),
    to measure what the huge-page slabs buy, in the same run."""

    key = "ep_kvcache_4k"

    def __init__(self, data: StepData, threads: Sequence[int]):
        was = _core.huge_pages()
        _core.set_huge_pages(False)
        try:
            super().__init__(data, threads)
        finally:
            _core.set_huge_pages(was)


class StreamLimit(Candidate):
    """``limit``: one vectorized read of the step's K+V bytes (layer arrays in order).

    With ``threads`` > 1 the concatenated byte stream is split into equal
    contiguous parts read concurrently (``_core.stream_read`` releases the GIL).
    """

    key = "limit"

    def __init__(self, data: StepData, threads: Sequence[int]):
        self.flat = [a.reshape(-1).view(np.uint8) for pair in zip(data.past_keys, data.past_values)
                     for a in pair]
        self.parts = {t: self._split(max(1, int(t))) for t in threads}
        n = max(threads)
        self.pool = concurrent.futures.ThreadPoolExecutor(n - 1) if n > 1 else None

    def _split(self, n: int) -> List[List[np.ndarray]]:
        total = sum(a.nbytes for a in self.flat)
        parts: List[List[np.ndarray]] = [[] for _ in range(n)]
        bounds = [total * i // n for i in range(n + 1)]
        pos = 0
        for a in self.flat:
            for t in range(n):
                lo, hi = max(bounds[t], pos), min(bounds[t + 1], pos + a.nbytes)
                if lo < hi:
                    parts[t].append(a[lo - pos:hi - pos])
            pos += a.nbytes
        return parts

    @staticmethod
    def _read(arrays) -> int:
        s = 0
        for a in arrays:
            s ^= _core.stream_read(a)
        return s

    def step(self, threads: int) -> None:
        parts = self.parts[threads]
        futures = [self.pool.submit(self._read, p) for p in parts[1:]]
        self._read(parts[0])
        for f in futures:
            f.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        self.parts = {}
        self.flat = []
