"""End-to-end benchmark bookkeeping with fake runners: contexts clamped to the model's
positions, failures reported per point with the rest kept, the physical limit, the prefill
profile split. No model is run and nothing is timed."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_light_ep import bench
from onnx_light_ep.bench import e2e, report
from onnx_light_ep.bench.e2e_model import decode_limit_tokens_per_s, decode_read_bytes, split_profile


def test_clamp_context_leaves_room_for_the_steps():
    assert e2e.clamp_context(4096, 8192, 19) == (4096, None)
    ctx, note = e2e.clamp_context(8192, 8192, 19)
    assert ctx == 8172 and "clamped to 8172" in note and "8192 positions" in note
    assert e2e.clamp_context(8172, 8192, 19) == (8172, None)
    assert e2e.clamp_context(10 ** 6, None, 19) == (10 ** 6, None)


def test_decode_read_bytes_counts_one_row_of_gathered_tables(tmp_path):
    emb = numpy_helper.from_array(np.zeros((10, 4), np.float32), "emb")
    w = numpy_helper.from_array(np.zeros((4, 6), np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["x"]), helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 6])], [emb, w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g), str(path))
    got = decode_read_bytes(str(path))
    assert got == {"weights": 4 * 6 * 4 + 4 * 4, "initializers": 10 * 4 * 4 + 4 * 6 * 4, "gather_tables": 160}
    # 1 GB/s, 1000 B of weights + 10 B per position at context 100: 1e9 / 2000 tokens/s
    assert decode_limit_tokens_per_s(1000, 10, 100, 1.0) == pytest.approx(5e5)
    assert decode_limit_tokens_per_s(1000, 10, 100, None) is None


def test_split_profile_takes_the_last_run_and_counts_ep_nodes_as_attention():
    def node(op, ts, dur, provider="CPUExecutionProvider"):
        return {"cat": "Node", "name": f"n_{op}_kernel_time", "ts": ts, "dur": dur,
                "args": {"op_name": op, "provider": provider}}

    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 100}, node("MatMul", 10, 50),
              {"cat": "Session", "name": "model_run", "ts": 1000, "dur": 10000},
              node("MatMul", 1100, 6000), node("OnnxLightExecutionProvider_abc_0", 7200, 3000),
              node("Mul", 10300, 1000), {"cat": "Node", "name": "n_fence_before", "ts": 1100, "dur": 5,
                                         "args": {"op_name": "MatMul"}}]
    s = split_profile(events)
    assert s["run_ms"] == 10.0 and s["node_ms"] == 10.0
    assert (s["matmul_ms"], s["attention_ms"], s["other_ms"]) == (6.0, 3.0, 1.0)
    assert s["attention_share"] == pytest.approx(0.3) and s["by_op"]["CacheAttention (EP)"] == 3.0


class _Fake:
    def __init__(self, key, fail_at=None, ids=(5, 6, 7, 8, 9, 10)):
        self.key, self.fail_at, self.ids = key, fail_at, list(ids)
        self.starts = []

    def start(self, prompt, capacity):
        self.starts.append((prompt.shape[1], capacity))
        self.i = 0
        return self.ids[0]

    def step(self):
        self.i += 1
        if self.fail_at is not None and self.i == self.fail_at:
            raise RuntimeError("position out of the rotary table")
        return self.ids[self.i]

    def stop(self):
        pass


def _model(positions=64):
    return e2e.E2EModel(name="fake", precision="fp32", src_dir="/nonexistent", converted="/nonexistent",
                        positions=positions, vocab_size=1000, num_layers=2, kv_num_heads=1, head_dim=4,
                        weight_bytes=1000)


def test_run_model_clamps_reports_failures_and_keeps_the_rest():
    fakes = {}

    def makers(model, t):
        def make(key, **kw):
            def f(so_patch=None):
                fakes[(key, t)] = _Fake(key, **kw)
                return fakes[(key, t)]
            return f
        return [("ep_kvcache", make("ep_kvcache", fail_at=None if t == 1 else 2)),
                ("ort_past_present", make("ort_past_present")),
                ("genai", lambda so_patch=None: (_ for _ in ()).throw(ImportError("no onnxruntime_genai")))]

    points = []
    bw = iter([0.5e-6, 1e-6, 0.1e-6, 2e-6])  # after each point; the limits use the best per thread count
    out = e2e.run_model(_model(), (16, 64), (1, 2), warmup=1, reps=3, bandwidth={"1": 0.2e-6},
                        profile_context=None, makers=makers, progress=lambda s: None,
                        on_point=lambda: points.append(1), measure_bandwidth=lambda t: next(bw))
    assert out["read_gb_per_s_best"] == {"1": 1e-6, "2": 2e-6}
    assert out["runs"][2]["limit_read_gb_per_s"] == 2e-6
    assert len(points) == 4 and len(out["runs"]) == 4
    assert out["errors"] == {"genai@1": "ImportError: no onnxruntime_genai", "genai@2": "ImportError: no onnxruntime_genai"}
    r16, r64 = out["runs"][0], out["runs"][1]
    assert r16["context_length"] == 16 and "note" not in r16
    assert r64["requested_context"] == 64 and r64["context_length"] == 64 - 4 - 1 and "clamped" in r64["note"]
    assert fakes[("ep_kvcache", 1)].starts[-1] == (59, 64)  # capacity within the positions
    ep = r16["runners"]["ep_kvcache"]
    assert ep["status"] == "ok" and len(ep["samples_ms"]) == 3 and ep["ttft_s"] >= 0
    # limit: 1 kB/s over 1000 B of weights + 16 positions x 2 x 2 layers x 1 head x 4 x 4 B
    assert r16["limit_tokens_per_s"] == pytest.approx(1e3 / (1000 + 16 * 64))
    assert ep["x_limit"] == pytest.approx(r16["limit_tokens_per_s"] / ep["tokens_per_s"])
    assert r16["tokens_agree"] == {"ep_kvcache": True}
    bad = out["runs"][2]["runners"]["ep_kvcache"]  # 2 threads: the EP fails at its second step
    assert bad["status"].startswith("error at decode step 1: RuntimeError: position out of the rotary table")
    assert out["runs"][2]["runners"]["ort_past_present"]["status"] == "ok"
    md = "\n".join(e2e.markdown_lines({"models": [out]}))
    assert "59*" in md and "clamped to 59" in md and "error at decode step 1" in md
    assert "genai@1: ImportError" in md


@pytest.mark.parametrize("threads,interleaved", [(1, True), (2, False)])
def test_decode_steps_interleave_at_one_thread_and_run_back_to_back_with_more(threads, interleaved):
    """1 thread: one step of each runner in turn (a shared machine's slow spells hit all alike);
    more threads: each runner's steps right after its prefill (ORT's pool spins on after a run).
    A runner failing mid-way is reported and leaves the others' rounds intact."""
    log = []

    class Logged(_Fake):
        def start(self, prompt, capacity):
            log.append((self.key, "start"))
            return super().start(prompt, capacity)

        def step(self):
            log.append((self.key, "step"))
            return super().step()

    def makers(model, t):
        return [("ep_kvcache", lambda so_patch=None: Logged("ep_kvcache")),
                ("ort_past_present", lambda so_patch=None: Logged("ort_past_present", fail_at=2))]

    out = e2e.run_model(_model(), (16,), (threads,), warmup=1, reps=3, profile_context=None, makers=makers,
                        progress=lambda s: None, measure_bandwidth=lambda t: 1.0)
    run = out["runs"][0]
    assert run["interleaved"] is interleaved
    E, O = "ep_kvcache", "ort_past_present"
    if interleaved:
        assert log == [(E, "start"), (O, "start"), (E, "step"), (O, "step"), (E, "step"), (O, "step"),
                       (E, "step"), (E, "step")]
    else:
        assert log == [(E, "start"), (E, "step"), (E, "step"), (E, "step"), (E, "step"),
                       (O, "start"), (O, "step"), (O, "step")]
    assert run["runners"][E]["status"] == "ok" and len(run["runners"][E]["samples_ms"]) == 3
    assert run["runners"][O]["status"].startswith("error at decode step 1")
    assert "ttft_s" in run["runners"][O]


def test_run_e2e_keeps_one_model_when_the_other_fails(monkeypatch, tmp_path):
    def load(precision, work_dir, progress):
        if precision == "int4":
            raise FileNotFoundError("int4 export missing")
        return _model()

    monkeypatch.setattr(e2e, "load_model", load)
    monkeypatch.setattr("onnx_light_ep.bench.machine.read_bandwidth_gb_per_s", lambda t, repeats=3: 1.0)
    monkeypatch.setattr(e2e, "default_makers", lambda m, t: [("ep_kvcache", lambda so_patch=None: _Fake("ep_kvcache"))])
    seen = []
    out = e2e.run_e2e((16,), (1,), warmup=1, reps=2, work_dir=str(tmp_path), progress=lambda s: None,
                      on_point=lambda partial: seen.append(json.dumps(partial, default=str)), quick=True)
    fp32, int4 = out["models"]
    assert fp32["runs"][0]["runners"]["ep_kvcache"]["status"] == "ok"
    assert int4["failed"] == "FileNotFoundError: int4 export missing" and int4["runs"] == []
    assert seen and "int4 export missing" in seen[-1]
    assert "FAILED: FileNotFoundError: int4 export missing" in "\n".join(e2e.markdown_lines(out))


def test_run_bench_keeps_the_grid_when_end_to_end_fails(monkeypatch, tmp_path):
    def boom(*a, **kw):
        raise RuntimeError("no model")

    monkeypatch.setattr(e2e, "run_e2e", boom)
    cfg = bench.BenchConfig(4, 2, 1, 32, "float32", head_dim=16, num_layers=1)
    res = bench.run_bench([cfg], threads=(1,), quick=True, out_dir=str(tmp_path), plot=False, e2e=True,
                          candidates=("limit", "ep_kvcache"), progress=lambda s: None)
    on_disk = json.loads((tmp_path / "bench_decode.json").read_text())
    assert on_disk["results"][0]["runs"][0]["candidates"]["ep_kvcache"]["status"] == "ok"
    assert on_disk["end_to_end"]["failed"] == "RuntimeError: no model"
    assert "End to end FAILED: RuntimeError: no model" in report.markdown(res)
