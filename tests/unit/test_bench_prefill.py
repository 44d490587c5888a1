"""Prefill-attention benchmark bookkeeping: the causal multiply-add count, the floor, and a
failing candidate reported while the others are measured (tiny shapes; no timing asserts)."""
from __future__ import annotations

import json

import pytest

from onnx_light_ep.bench import prefill


def test_causal_macs_and_floor():
    # S=4: rows see 1+2+3+4 = 10 keys; per key D (q.k) + Dv (P.V)
    assert prefill.causal_macs(4, 2, 8) == 2 * 10 * 16
    assert prefill.causal_macs(4, 2, 8, v_head_dim=4, batch_size=3) == 3 * 2 * 10 * 12
    m = {"isa": "avx2", "fma_peak_gfma_per_s": {"fp32_avx2": 50.0, "fp32_avx512": 100.0}}
    assert prefill.compute_floor_ms(10 ** 9, m) == pytest.approx(20.0)
    assert prefill.compute_floor_ms(10 ** 9, {**m, "isa": "avx512_bf16"}, threads=2) == pytest.approx(5.0)
    assert prefill.compute_floor_ms(10 ** 9, {**m, "isa": "scalar"}) is None


def test_run_shape_outputs_agree_and_a_failing_candidate_is_reported(monkeypatch, tmp_path):
    real = prefill._build

    def build(key, *a):
        if key == "ort_gqa":
            raise RuntimeError("no GQA here")
        return real(key, *a)

    monkeypatch.setattr(prefill, "_build", build)
    m = {"isa": "avx512", "fma_peak_gfma_per_s": {"fp32_avx512": 100.0}}
    rec = prefill.run_shape(32, 4, 2, 16, warmup=1, reps=2, machine=m)
    run = rec["runs"][0]
    assert run["compute_floor_ms"] == pytest.approx(prefill.causal_macs(32, 4, 16) / 100e9 * 1e3)
    for key in ("ep_kvcache", "ort_attention"):
        e = run["candidates"][key]
        assert e["status"] == "ok" and len(e["samples_ms"]) == 2 and e["x_floor"] > 0
    assert run["candidates"]["ort_gqa"]["status"] == "error: RuntimeError: no GQA here"
    # the EP's causal prefill over its cache = ORT's causal Attention (fp32)
    assert rec["output_max_abs_diff_vs_ort_attention"]["ep_kvcache"] < 1e-5
    res = {"machine": m, "settings": {"warmup": 1, "reps": 2}, "results": [rec, {"name": "S=8 1/1",
                                                                                 "failed": "X: y", "runs": []}]}
    md = prefill.markdown(res)
    assert "error: RuntimeError: no GQA here" in md and "FAILED: X: y" in md
    path = tmp_path / "B.md"
    prefill.update_benchmarks_md(str(path), {**res, "machine": {**m, "machine_kind": "AMD Zen 3 AVX2"}})
    assert "<!-- bench_prefill[AMD Zen 3 AVX2]:end -->" in path.read_text()
    json.dumps(rec)  # JSON-able
