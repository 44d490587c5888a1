"""Run an original model (plain ORT CPU, presents fed back) and its conversion (EP + KVCache) on the same feeds."""
import os

import numpy as np
import onnx
import onnxruntime as ort

import onnx_light_ep as ole
from onnx_light_ep.rewrite import convert

EP_NAME = "OnnxLightExecutionProvider"


def so():
    s = ort.SessionOptions()
    s.log_severity_level = 3
    return s


def save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, str(path))
    return str(path)


def convert_model(model, tmp_path, name="m", **kw):
    """Save ``model``, convert it; returns (report, original_path, converted_path)."""
    src = save(model, tmp_path / f"{name}.onnx")
    dst = str(tmp_path / f"{name}.light.onnx")
    return convert(src, dst, **kw), src, dst


def sessions(src, dst):
    a = ort.InferenceSession(src, so(), providers=["CPUExecutionProvider"])
    b = ole.InferenceSession(dst, so())
    assert b.get_providers()[0] == EP_NAME
    return a, b


def left_padded(rows, pad=0):
    """input_ids / attention_mask [B, S] for left-padded token rows."""
    s = max(len(r) for r in rows)
    ids = np.full((len(rows), s), pad, np.int64)
    mask = np.zeros((len(rows), s), np.int64)
    for b, r in enumerate(rows):
        ids[b, s - len(r):] = r
        mask[b, s - len(r):] = 1
    return ids, mask


def right_padded(rows, pad=0):
    s = max(len(r) for r in rows)
    ids = np.full((len(rows), s), pad, np.int64)
    mask = np.zeros((len(rows), s), np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
        mask[b, :len(r)] = 1
    return ids, mask


def run_pair(src, dst, report, steps, batch, *, init_past=None, max_len=64):
    """Run every feed dict of ``steps`` through both models.

    The original gets ``past_*`` (zeros [B, Hkv, 0, D] first, or ``init_past``)
    and returns presents that become the next pasts; the converted model gets
    ``kv_cache``. Returns (outputs_original, outputs_converted, cache_lengths)
    as lists of dicts per step.
    """
    a, b = sessions(src, dst)
    pasts = {}
    for x in report.layers:
        for p, q, dd in (("past_key", "present_key", report.head_dim), ("past_value", "present_value",
                                                                         report.v_head_dim)):
            if x[p]:
                pasts[x[p]] = (x[q], np.zeros((batch, report.kv_num_heads, 0, dd), np.float32))
    if init_past is not None:
        for k, v in init_past.items():
            if k in pasts:
                pasts[k] = (pasts[k][0], v)
    names_a = [o.name for o in a.get_outputs()]
    names_b = [o.name for o in b.get_outputs()]
    in_a = {i.name for i in a.get_inputs()}
    in_b = {i.name for i in b.get_inputs()}
    # layers left unconverted keep their past/present tensors in the converted model too
    kept = {p: (q, np.zeros((batch, report.kv_num_heads, 0, report.head_dim), np.float32))
            for p, q in report.metadata.get("tensor_pairs", [])}
    pasts.update(kept)
    if init_past is not None:
        kept.update({k: (kept[k][0], v) for k, v in init_past.items() if k in kept})
    outs_a, outs_b, lengths = [], [], []
    with ole.KVCache.for_model(dst, batch, max_len) as cache:
        for feeds in steps:
            fa = {k: v for k, v in feeds.items() if k in in_a}
            fa.update({k: v for k, (_, v) in pasts.items()})
            ra = dict(zip(names_a, a.run(None, fa)))
            pasts = {k: (q, ra[q]) for k, (q, _) in pasts.items()}
            fb = {k: v for k, v in feeds.items() if k in in_b}
            fb[report.cache_input] = cache.handle
            fb.update({k: v for k, (_, v) in kept.items()})
            rb = dict(zip(names_b, b.run(None, fb)))
            kept = {k: (q, rb[q]) for k, (q, _) in kept.items()}
            outs_a.append(ra)
            outs_b.append(rb)
            lengths.append(cache.seq_lens.tolist())
    return outs_a, outs_b, lengths


def greedy_steps(src, dst, report, prompt_rows, n_decode, *, padding="left", max_len=64, atol=1e-4):
    """Prefill + ``n_decode`` greedy steps (next token from the original's logits) on both models.

    Asserts the logits of every real position agree within ``atol`` and the
    argmax agrees; returns (max_abs_error, generated ids per row).
    """
    a, b = sessions(src, dst)
    from onnx_light_ep._runner import DecodeState, PastFeeds, layer_pairs
    from onnx_light_ep.rewrite import read_metadata

    meta = read_metadata(dst)
    state = DecodeState(prompt_rows, padding)
    pasts = PastFeeds(a, layer_pairs(meta), len(prompt_rows), meta["head_dim"], meta["v_head_dim"])
    names_a = [o.name for o in a.get_outputs()]
    worst, gen = 0.0, [[] for _ in prompt_rows]
    with ole.KVCache.for_model(dst, len(prompt_rows), max_len) as cache:
        for step in range(n_decode + 1):
            ra = dict(zip(names_a, a.run(None, dict(state.feeds(a), **pasts.values))))
            pasts.update(ra)
            lb = b.run(["logits"], dict(state.feeds(b), **{meta["cache_input"]: cache.handle}))[0]
            la = ra["logits"]
            for row, cols in state.valid_positions():
                err = float(np.abs(la[row, cols].astype(np.float64) - lb[row, cols]).max())
                worst = max(worst, err)
                assert err <= atol, f"step {step} row {row}: max |dlogits| {err} > {atol}"
            na, nb = state.last_logits(la).argmax(-1), state.last_logits(lb).argmax(-1)
            assert np.array_equal(na, nb), f"step {step}: argmax {na} != {nb}"
            for row, t in enumerate(na):
                gen[row].append(int(t))
            state.advance(na)
    return worst, gen


def file_digest(path):
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest(), os.path.getmtime(path)
