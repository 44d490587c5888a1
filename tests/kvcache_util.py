"""Helpers shared by the KVCache API / safety / property tests.

Owned by test_kvcache_api.py, test_safety.py and test_arena_property.py.
Builds small CacheAttention models (unlike models.py: every q/k/v dim dynamic
so wrong geometries reach the op, a `layer` override, and optional layer
ordering), keeps a pure-numpy model of a cache's content, and computes
the expected CacheAttention output with the numpy oracle.
"""
from __future__ import annotations

import copy
import re

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper

from reference import ref_attn as _shared_ref_attn  # tests/ is on sys.path (conftest.py)

DOMAIN = "ai.onnx_light"

ONNX_TYPE = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
}
NP_DTYPE = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}

STATS_KEYS = (
    "committed_bytes",
    "live_bytes",
    "reserved_bytes",
    "bytes_appended",
    "bytes_copied",
    "num_appends",
)


def ref_attn(q, k_new, v_new, past_k=None, past_v=None, *, scale=None, causal=True):
    """Output of the shared CASES.md oracle (tests/reference.py)."""
    return _shared_ref_attn(q, k_new, v_new, past_k, past_v, scale=scale, causal=causal)[0]


# --------------------------------------------------------------------------
# models


def build_model(
    num_layers: int = 1,
    *,
    dtype: str = "float32",
    layers=None,
    seqlens_k: bool = False,
    chain=None,
    is_causal: int = 1,
    windows=None,
) -> bytes:
    """A graph of `num_layers` CacheAttention nodes sharing one `cache` input.

    Inputs: `kv_cache` int64 [1]; per node i `query_i`, `key_i`, `value_i`
    (BNSH, all dims dynamic so tests can feed wrong geometries); optional
    `seqlens_k` int32 [B]. Outputs `Y_i`. `layers[i]` is node i's `layer`
    attribute (default i). With `chain`, node i's query is
    `query_i + 0 * ReduceSum(Y_{i-1})`, which forces node i to run after node
    i-1 without changing any value (float32 only). docs/API.md requires layers
    to append in order within a run, so `chain` defaults to num_layers > 1.
    `windows[i]`: node i's local_window_size (None or -1 = none).
    """
    t = ONNX_TYPE[dtype]
    chain = num_layers > 1 if chain is None else chain
    layers = list(range(num_layers)) if layers is None else list(layers)
    inputs = [helper.make_tensor_value_info("kv_cache", TensorProto.INT64, [1])]
    outputs, nodes, inits = [], [], []
    if chain:
        inits.append(helper.make_tensor("zero", t, [], [0.0]))
    for i in range(num_layers):
        for name in ("query", "key", "value"):
            inputs.append(helper.make_tensor_value_info(f"{name}_{i}", t, [None] * 4))
        q = f"query_{i}"
        if chain and i > 0:
            nodes += [
                helper.make_node("ReduceSum", [f"Y_{i-1}"], [f"sum_{i}"], keepdims=0),
                helper.make_node("Mul", [f"sum_{i}", "zero"], [f"zsum_{i}"]),
                helper.make_node("Add", [q, f"zsum_{i}"], [f"q_{i}"]),
            ]
            q = f"q_{i}"
        ins = [q, f"key_{i}", f"value_{i}", "kv_cache"]
        if seqlens_k:
            ins += ["", "seqlens_k"]
        nodes.append(
            helper.make_node(
                "CacheAttention",
                ins,
                [f"Y_{i}"],
                domain=DOMAIN,
                layer=int(layers[i]),
                is_causal=int(is_causal),
                **({"local_window_size": int(windows[i])} if windows and windows[i] not in (None, -1) else {}),
            )
        )
        outputs.append(helper.make_tensor_value_info(f"Y_{i}", t, None))
    if seqlens_k:
        inputs.append(helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [None]))
    graph = helper.make_graph(nodes, "cache_attention_test", inputs, outputs, inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
        ir_version=10,
    )
    return model.SerializeToString()


def make_session(model: bytes, mode: str, threads: int = 1):
    """mode 'ep': onnx_light_ep.InferenceSession (EP selected and first);
    mode 'cpu': plain onnxruntime CPU EP with the custom-op library."""
    import onnxruntime as ort

    import onnx_light_ep

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if mode == "ep":
        sess = onnx_light_ep.InferenceSession(model, so)
        assert sess.get_providers()[0] == onnx_light_ep.EP_NAME
        return sess
    assert mode == "cpu"
    so.register_custom_ops_library(onnx_light_ep.get_library_path())
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"]
    return sess


def feeds_for(cache_handle, qkv, seqlens_k=None):
    """qkv: list over nodes of (q, k, v)."""
    feeds = {"kv_cache": cache_handle}
    for i, (q, k, v) in enumerate(qkv):
        feeds[f"query_{i}"] = q
        feeds[f"key_{i}"] = k
        feeds[f"value_{i}"] = v
    if seqlens_k is not None:
        feeds["seqlens_k"] = np.asarray(seqlens_k, np.int32)
    return feeds


def random_qkv(rng, num_layers, B, Hq, Hkv, S, D, Dv=None, dtype="float32"):
    Dv = D if Dv is None else Dv
    dt = NP_DTYPE[dtype]
    out = []
    for _ in range(num_layers):
        q = rng.standard_normal((B, Hq, S, D)).astype(np.float32).astype(dt)
        k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32).astype(dt)
        v = rng.standard_normal((B, Hkv, S, Dv)).astype(np.float32).astype(dt)
        out.append((q, k, v))
    return out


# --------------------------------------------------------------------------
# numpy model of a cache


class RefCache:
    """Per layer, per sequence: K [Hkv, len, D] and V [Hkv, len, Dv]."""

    def __init__(self, num_layers, batch_size, kv_num_heads, head_dim, v_head_dim=None,
                 dtype="float32", capacity=None, *, windows=None, rollback_tokens=0, page_tokens=128,
                 kv_quant=None, recent_tokens=128, sink_tokens=4):
        self.L, self.B, self.H, self.D = num_layers, batch_size, kv_num_heads, head_dim
        # int8 cold pages (docs/API.md "Quantized pages"): qnext[l][b] = first block quantization
        # has not considered; a block past it is quantized (values replaced by the codec's
        # dequantized ones) once it lies wholly in [sink_tokens rounded up to pages, len - recent).
        self.kv_quant, self.recent, self.sink = kv_quant, int(recent_tokens), int(sink_tokens)
        self.qnext = [[0] * batch_size for _ in range(num_layers)]
        # qmeta[l][b][(h, blk)]: (the codec's K codes and scales (int4: and minimums), its V codes
        # and steps) of a quantized block, for the kernels' fixed-point scores (reference.ref_attn
        # int8_pages) and P.V weights (reference.pv_rounding_atol)
        self.qmeta = [[{} for _ in range(batch_size)] for _ in range(num_layers)]
        # Sliding-window eviction (docs/API.md): per layer window (0 = none); first[l][b] is the
        # first position layer l of sequence b still holds.
        self.windows = [int(w or 0) for w in windows] if windows else [0] * num_layers
        self.rollback, self.P = int(rollback_tokens), int(page_tokens)
        self.first = [[0] * batch_size for _ in range(num_layers)]
        self.Dv = head_dim if v_head_dim is None else v_head_dim
        self.dtype = NP_DTYPE[dtype]
        self.capacity = capacity
        self.k = [[np.zeros((self.H, 0, self.D), self.dtype) for _ in range(self.B)]
                  for _ in range(self.L)]
        self.v = [[np.zeros((self.H, 0, self.Dv), self.dtype) for _ in range(self.B)]
                  for _ in range(self.L)]

    @classmethod
    def from_past(cls, keys, values, capacity=None):
        L = len(keys)
        B, H, T, D = keys[0].shape
        r = cls(L, B, H, D, values[0].shape[3], str(keys[0].dtype), capacity)
        for l in range(L):
            for b in range(B):
                r.k[l][b] = keys[l][b].copy()
                r.v[l][b] = values[l][b].copy()
        return r

    def copy(self):
        return copy.deepcopy(self)

    @property
    def seq_lens(self):
        return np.array([self.k[0][b].shape[1] for b in range(self.B)], np.int64)

    def export(self, layer):
        n = int(self.seq_lens.max()) if self.B else 0
        K = np.zeros((self.B, self.H, n, self.D), self.dtype)
        V = np.zeros((self.B, self.H, n, self.Dv), self.dtype)
        for b in range(self.B):
            m, f = self.k[layer][b].shape[1], self.first[layer][b]
            K[b, :, f:m] = self.k[layer][b][:, f:]
            V[b, :, f:m] = self.v[layer][b][:, f:]
        return K, V

    def quantize(self):
        """After a commit (and the eviction): quantized cold pages, as the cache does."""
        if self.kv_quant is None:
            return
        from reference import quantize_page, value_codes

        P = self.P
        for l in range(self.L):
            for b in range(self.B):
                n = self.k[l][b].shape[1]
                end = min((n - self.recent) // P if n > self.recent else 0, -(-n // P))
                start = max(self.qnext[l][b], self.first[l][b] // P, -(-self.sink // P))
                for blk in range(start, end):
                    sl = slice(blk * P, (blk + 1) * P)
                    for h in range(self.H):
                        k, v = self.k[l][b][h, sl], self.v[l][b][h, sl]
                        if np.all(np.isfinite(k)) and np.all(np.isfinite(v)):
                            dk, dv, *meta = quantize_page(self.kv_quant, k, v, codes=True)
                            vmeta = value_codes(self.kv_quant, v)
                            self.k[l][b][h, sl], self.v[l][b][h, sl] = dk.astype(self.dtype), dv.astype(self.dtype)
                            self.qmeta[l][b][(h, blk)] = (meta, vmeta)
                self.qnext[l][b] = max(self.qnext[l][b], end)

    def evict(self):
        """After a commit: windowed layers drop whole pages before len - W - rollback."""
        for l, w in enumerate(self.windows):
            if w <= 0:
                continue
            for b in range(self.B):
                keep = self.k[l][b].shape[1] - w - self.rollback
                if keep > 0:
                    self.first[l][b] = max(self.first[l][b], keep // self.P * self.P)

    def earliest(self, b):
        """Shortest non-zero length truncate allows for sequence b."""
        e = 0
        for l, w in enumerate(self.windows):
            if w > 0 and self.first[l][b] > 0:
                e = max(e, self.first[l][b] + w - 1)
        return e

    def live_bytes(self):
        return int(self.seq_lens.sum()) * self.L * self.H * (self.D + self.Dv) * self.dtype.itemsize

    def truncate(self, lengths):
        lengths = np.broadcast_to(np.asarray(lengths, np.int64), (self.B,))
        for l in range(self.L):
            for b in range(self.B):
                self.k[l][b] = self.k[l][b][:, : lengths[b]].copy()
                self.v[l][b] = self.v[l][b][:, : lengths[b]].copy()
                if lengths[b] == 0:
                    self.first[l][b] = 0
                self.qnext[l][b] = min(self.qnext[l][b], int(lengths[b]) // self.P)
                # the page a cut falls into becomes native again (its kept rows dequantized)
                self.qmeta[l][b] = {hb: m for hb, m in self.qmeta[l][b].items()
                                    if (hb[1] + 1) * self.P <= int(lengths[b])}

    def reorder(self, idx):
        for l in range(self.L):
            self.k[l] = [self.k[l][i].copy() for i in idx]
            self.v[l] = [self.v[l][i].copy() for i in idx]
            self.first[l] = [self.first[l][i] for i in idx]
            self.qnext[l] = [self.qnext[l][i] for i in idx]
            self.qmeta[l] = [dict(self.qmeta[l][i]) for i in idx]
        self.B = len(idx)

    def reset(self):
        self.truncate(0)

    def fits(self, n):
        """Would appending n[b] rows to every sequence stay within capacity?"""
        return self.capacity is None or bool(np.all(self.seq_lens + np.asarray(n) <= self.capacity))

    def step(self, qkv, n=None, scale=None):
        """Expected outputs of one run (list per layer), then append the rows. Sets pv_atol: per
        layer the quantized pages' P.V tolerance of those outputs at the active ISA level
        (reference.pv_rounding_atol, [B, Hq, S, Dv]; 0.0 without quantized pages)."""
        from reference import pv_rounding_atol

        from onnx_light_ep import _core

        ys, self.pv_atol = [], []
        for l, (q, k, v) in enumerate(qkv):
            B, Hq, S, _ = q.shape
            nn = [S] * B if n is None else list(n)
            y = np.zeros((B, Hq, S, v.shape[3]), np.float64)
            tol = np.zeros_like(y)
            for b in range(B):
                m = nn[b]
                if m == 0:
                    continue
                pk = self.k[l][b][None]
                pv = self.v[l][b][None]
                w = self.windows[l] or None
                metas = sorted(self.qmeta[l][b].items())
                pages = [(0, h, blk * self.P, *km) for (h, blk), (km, _) in metas]
                y[b, :, :m], p, _, _ = _shared_ref_attn(q[b:b + 1, :, :m], k[b:b + 1, :, :m], v[b:b + 1, :, :m],
                                                        pk, pv, scale=scale, causal=True, window=w, int8_pages=pages)
                vpages = [(0, h, blk * self.P, *vm) for (h, blk), (_, vm) in metas]
                tol[b, :, :m] = pv_rounding_atol(_core.isa(), p, vpages, Hq // self.H)
            ys.append(y)
            self.pv_atol.append(tol)
        for l, (q, k, v) in enumerate(qkv):
            B, _, S, _ = q.shape
            nn = [S] * B if n is None else list(n)
            for b in range(B):
                self.k[l][b] = np.concatenate([self.k[l][b], k[b, :, : nn[b]]], 1)
                self.v[l][b] = np.concatenate([self.v[l][b], v[b, :, : nn[b]]], 1)
        self.evict()
        self.quantize()
        return ys


def bits(a):
    """View an array as unsigned ints of its width (bit-exact comparisons)."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bit_equal(got, want, what=""):
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.array_equal(bits(got), bits(want)), f"{what}: content differs"


def snapshot(cache):
    """(seq_lens, [(K, V) per layer]) copied out of a KVCache."""
    return (np.array(cache.seq_lens, copy=True),
            [tuple(np.array(a, copy=True) for a in cache.export(l)) for l in range(cache.num_layers)])


def assert_snapshot_equal(cache, snap, what=""):
    seq, layers = snap
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), seq, err_msg=f"{what}: seq_lens changed")
    for l, (k, v) in enumerate(layers):
        k2, v2 = cache.export(l)
        assert_bit_equal(k2, k, f"{what}: layer {l} key")
        assert_bit_equal(v2, v, f"{what}: layer {l} value")


def assert_cache_matches(cache, ref: RefCache, what=""):
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), ref.seq_lens, err_msg=f"{what}: seq_lens")
    for l in range(ref.L):
        k, v = cache.export(l)
        rk, rv = ref.export(l)
        assert_bit_equal(k, rk, f"{what}: export({l}) key")
        assert_bit_equal(v, rv, f"{what}: export({l}) value")


def names(msg: str, *words: str) -> bool:
    """True if the error text names one of `words` as a whole lowercase word."""
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(w)}(?![A-Za-z_])", msg) for w in words)
