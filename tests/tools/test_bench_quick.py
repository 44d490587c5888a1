"""Smoke test of the decode benchmark (``onnx_light_ep.bench``): runs a tiny
configuration through every candidate and checks the JSON structure and the
byte accounting. Nothing is asserted about speed (benchmarks are never timed
unit tests)."""
from __future__ import annotations

import json

from onnx_light_ep import bench


def test_quick_json_structure(tmp_path):
    cfgs = [bench.BenchConfig(4, 2, 1, 64, "float32", head_dim=16, num_layers=2),
            bench.BenchConfig(4, 1, 2, 64, "bfloat16", head_dim=16, num_layers=1)]
    result = bench.run_bench(cfgs, threads=(1, 2), quick=True, out_dir=str(tmp_path), plot=False,
                             progress=lambda line: None)
    on_disk = json.loads((tmp_path / "bench_decode.json").read_text())
    assert on_disk["settings"]["warmup"] == 2 and on_disk["settings"]["reps"] == 3
    assert (tmp_path / "bench_decode.md").read_text().startswith("## Decode step")

    m = on_disk["machine"]
    for key in ("cpu_model", "num_cpus", "onnxruntime", "isa", "llc_bytes", "lscpu_caches"):
        assert key in m, key
    assert len(on_disk["results"]) == 2

    fp32, bf16 = on_disk["results"]
    assert [r["threads"] for r in fp32["runs"]] == [1, 2]
    for run in fp32["runs"]:
        c = run["candidates"]
        assert set(c) == set(bench.CANDIDATES)
        for key in ("limit", "ort_attention_past", "ort_gqa_shared", "ort_tensor_scatter", "ep_kvcache"):
            e = c[key]
            assert e["status"] == "ok", (key, e["status"])
            assert len(e["samples_ms"]) == 3 and len(e["warmup_ms"]) == 2
            assert e["p25_ms"] <= e["median_ms"] <= e["p75_ms"]
            assert e["min_ms"] <= e["median_ms"] <= e["max_ms"]
            assert e["x_limit"] > 0 and e["speedup_vs_ort_best"] > 0
        # the EP either ran the standard Attention itself or says it did not (never CPU under its name)
        assert c["ep_attention_past"]["status"] == "ok" or \
            c["ep_attention_past"]["status"].startswith("not claimed")
        ep = c["ep_kvcache"]
        # every CacheAttention ran fused on the EP; none on the CPU EP
        assert ep["providers"] == {"fused by OnnxLightExecutionProvider": ["OnnxLightExecutionProvider"]}
        assert ep["bytes_appended_per_step"] == run["append_bytes"] == 2 * 2 * 1 * 16 * 4 * 2
        assert ep["bytes_copied_per_step"] == 0
        assert c["ep_kvcache_block"]["status"] == "ok" and run["paged_vs_block"] > 0
        assert run["ort_best"] in ("ort_gqa_shared", "ort_tensor_scatter")
    # all candidates computed the same Y from the same state (harness sanity)
    for which in ("output_max_abs_diff_first_step", "output_max_abs_diff_last_step"):
        diffs = {k: v for k, v in fp32[which].items() if k != "reference"}
        assert diffs and max(diffs.values()) < 1e-4, (which, diffs)

    for run in bf16["runs"]:
        c = run["candidates"]
        assert c["ep_kvcache"]["status"] == "ok"
        assert c["limit"]["status"] == "ok"
        for key in ("ort_attention_past", "ort_gqa_shared", "ort_tensor_scatter"):
            assert c[key]["status"].startswith("unsupported"), (key, c[key]["status"])


def test_arena_quick(tmp_path):
    """Smoke test of the generation-operation benchmarks: every part runs and reports sane figures."""
    from onnx_light_ep.bench.arena import HKV, run_arena

    r = run_arena(str(tmp_path), quick=True, progress=lambda s: None)
    beam = r["beam"][0]
    assert beam["ep"]["median_ms"] > 0 and beam["ort_gather"]["median_ms"] > 0
    assert 0 < beam["ep_bytes_copied_per_step"] < beam["ort_bytes_copied_per_step"]
    assert r["fork"][0]["fork"]["median_ms"] > 0
    assert r["speculative"][0]["bytes_copied"] == 0  # checkpoint, truncate and restore copy no rows
    t = r["truncate_churn"]
    # each step starts a page per (layer, kv head); the pool that unmaps empty slabs maps them
    # again every step, the default pool reuses the ones it kept
    assert t["unmap_at_once_mapped_bytes_per_step"] >= t["num_layers"] * HKV * t["page_bytes"]
    assert t["keep_free_mapped_bytes_per_step"] == 0
    w = r["sliding_window"]
    assert all(row["evicting_committed_bytes"] <= w["bound_bytes"] for row in w["rows"])
    assert w["rows"][-1]["keeping_committed_bytes"] > w["rows"][-1]["evicting_committed_bytes"]
    assert (tmp_path / "bench_arena.md").read_text().startswith("Shape: GQA")


def test_cli_lists_every_file_it_wrote(tmp_path, capsys):
    from onnx_light_ep.cli import main

    assert main(["bench", "--quick", "--no-plot", "--out-dir", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("wrote ") and str(tmp_path / "bench_decode.json") in last
    assert str(tmp_path / "bench_decode.md") in last and "bench_decode.png" not in last
