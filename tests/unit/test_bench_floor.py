"""Decode-benchmark bookkeeping with fakes: the compute floor, the machine kind, per-machine
BENCHMARKS.md blocks, and failures reported without losing the run. No timing asserts."""
from __future__ import annotations

import json
import os
import re

import pytest

from onnx_light_ep import _core, bench
from onnx_light_ep.bench import decode, machine, report

PEAKS = {"fp32_avx2": 50.0, "fp32_avx512": 100.0, "bf16_avx512bf16": 80.0, "int16_avx2": None,
         "int16_avx512bw": None, "int16_avx512vnni": None}


def test_fma_peak_binding_levels_and_errors():
    levels = _core.fma_peak_levels()
    names = [lv["name"] for lv in levels]
    assert names == ["fp32_avx2", "fp32_avx512", "bf16_avx512bf16", "int16_avx2", "int16_avx512bw",
                     "int16_avx512vnni"]
    for lv in levels:
        g = _core.fma_peak(lv["name"], 1.0, 1)
        assert (g is None) == (not lv["supported"]), lv
        assert g is None or g > 0
    with pytest.raises(ValueError, match="fma_peak: level; expected one of fp32_avx2"):
        _core.fma_peak("fp64_avx9")
    with pytest.raises(ValueError, match="ms"):
        _core.fma_peak("fp32_avx2", 0.0)
    with pytest.raises(ValueError, match="trials"):
        _core.fma_peak("fp32_avx2", 1.0, 0)


def test_compute_ms_counts_qk_and_pv_at_the_level_peak():
    cfg = bench.BenchConfig(32, 1, 2, 4096, "float32", head_dim=128, num_layers=3)
    macs = decode.step_macs(cfg)
    assert macs == {"qk": 2 * 32 * 3 * 4096 * 128, "pv": 2 * 32 * 3 * 4096 * 128}
    m = {"isa": "avx512", "fma_peak_gfma_per_s": PEAKS}
    assert decode.compute_ms(cfg, m, 1) == pytest.approx(2 * macs["qk"] / 100e9 * 1e3)
    assert decode.compute_ms(cfg, m, 2) == pytest.approx(macs["qk"] / 100e9 * 1e3)
    assert decode.compute_ms(cfg, {**m, "isa": "avx2"}, 1) == pytest.approx(2 * macs["qk"] / 50e9 * 1e3)
    # bf16 K on the avx512_bf16 level: q.k at the pair-dot peak, P.V at the fp32 FMA peak
    b = bench.BenchConfig(32, 1, 2, 4096, "bfloat16", head_dim=128, num_layers=3)
    assert decode.compute_ms(b, {**m, "isa": "avx512_bf16"}, 1) == pytest.approx(
        (macs["qk"] / 80e9 + macs["pv"] / 100e9) * 1e3)
    assert decode.compute_ms(b, m, 1) == pytest.approx(2 * macs["qk"] / 100e9 * 1e3)
    # MHA bf16 (one query row per KV head): no VDPBF16PS path, q.k at the fp32 FMA peak too
    mha = bench.BenchConfig(32, 32, 2, 4096, "bfloat16", head_dim=128, num_layers=3)
    assert decode.compute_ms(mha, {**m, "isa": "avx512_bf16"}, 1) == pytest.approx(
        2 * decode.step_macs(mha)["qk"] / 100e9 * 1e3)
    assert decode.compute_ms(cfg, {**m, "isa": "scalar"}, 1) is None
    assert decode.compute_ms(cfg, {"isa": "avx2"}, 1) is None  # peaks not measured


def _rec(cfg, limit_ms, ep_ms, threads=1):
    def entry(ms):
        return {"median_ms": ms, "p25_ms": ms, "p75_ms": ms}

    return {"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
            "runs": [{"threads": threads, "candidates": {"limit": entry(limit_ms), "ep_kvcache": entry(ep_ms)}}]}


def test_add_floors_picks_the_bound():
    m = {"isa": "avx512", "fma_peak_gfma_per_s": PEAKS}
    mqa = bench.BenchConfig(32, 1, 1, 4096, "float32", num_layers=24)   # compute 6.4 ms
    rec = _rec(mqa, 4.0, 16.0)
    decode.add_floors(rec, m)
    run = rec["runs"][0]
    assert run["compute_ms"] == pytest.approx(24 * 32 * 4096 * 256 / 100e9 * 1e3)
    assert run["bound"] == "compute" and run["floor_ms"] == run["compute_ms"]
    assert run["candidates"]["ep_kvcache"]["x_floor"] == pytest.approx(16.0 / run["compute_ms"])
    mha = bench.BenchConfig(32, 32, 1, 4096, "float32", num_layers=1)
    rec = _rec(mha, 5.0, 6.0)
    decode.add_floors(rec, m)
    assert rec["runs"][0]["bound"] == "read" and rec["runs"][0]["floor_ms"] == 5.0
    assert "| 0.336 | 5 R |" in report._row({**rec, "name": mha.name(), "working_set_bytes": 1},
                                             rec["runs"][0])
    rec = _rec(mha, 5.0, 6.0)
    decode.add_floors(rec, {"isa": "scalar"})  # no peak: the floor is the read limit
    assert rec["runs"][0]["compute_ms"] is None and rec["runs"][0]["floor_ms"] == 5.0


@pytest.mark.parametrize("fields, kind", [
    ({"Vendor ID": "AuthenticAMD", "Model name": "AMD EPYC 7B13", "CPU family": "25", "Model": "1",
      "Flags": "avx2 fma"}, "AMD Zen 3 AVX2"),
    ({"Vendor ID": "AuthenticAMD", "Model name": "AMD EPYC", "CPU family": "25", "Model": "17",
      "Flags": "avx2 avx512f"}, "AMD Zen 4 AVX-512"),
    ({"Vendor ID": "AuthenticAMD", "Model name": "AMD EPYC", "CPU family": "23", "Model": "1",
      "Flags": "avx2 fma"}, "AMD Zen 1 AVX2"),
    ({"Vendor ID": "AuthenticAMD", "Model name": "AMD EPYC 7B12", "CPU family": "23", "Model": "49",
      "Flags": "avx2 fma"}, "AMD Zen 2 AVX2"),
    ({"Vendor ID": "AuthenticAMD", "Model name": "AMD Ryzen 7 2700X", "CPU family": "23", "Model": "8",
      "Flags": "avx2 fma"}, "AMD Zen+ AVX2"),
    ({"Vendor ID": "GenuineIntel", "Model name": "Intel(R) Xeon(R) Processor", "CPU family": "6",
      "Model": "167", "Flags": "avx2 avx512f"}, "Intel Xeon (family 6 model 167) AVX-512"),
    ({"Vendor ID": "GenuineIntel", "Model name": "Intel(R) Xeon(R) Platinum 8480", "CPU family": "6",
      "Model": "143", "Flags": "avx2 avx512f"}, "Intel Sapphire Rapids AVX-512"),
])
def test_machine_kind(fields, kind):
    assert machine.machine_kind(fields) == kind


def test_source_revision_env_and_checkout(monkeypatch):
    monkeypatch.setenv("OLEP_SOURCE_REVISION", "abc123")
    assert machine.source_revision() == "abc123"
    monkeypatch.delenv("OLEP_SOURCE_REVISION")
    rev = machine.source_revision()
    assert rev.startswith("onnx_light_ep ") or len(rev.split("-")[0]) == 12


def test_recorded_revision(tmp_path):
    """The commit the build wrote next to the package: read back stripped; none when the file is
    missing or empty (a build from an sdist)."""
    p = tmp_path / "source_revision.txt"
    assert machine.recorded_revision(str(p)) is None
    p.write_text("\n")
    assert machine.recorded_revision(str(p)) is None
    p.write_text("0123456789ab-dirty\n")
    assert machine.recorded_revision(str(p)) == "0123456789ab-dirty"


def test_installed_package_records_its_revision(monkeypatch):
    """The CMake build installs source_revision.txt beside the package's modules; an installed
    package built from a git checkout reports that commit, not only its version."""
    monkeypatch.delenv("OLEP_SOURCE_REVISION", raising=False)
    checkout = machine.checkout_revision()
    if checkout is not None:  # imported from a git checkout, not an installed package: its HEAD
        assert machine.source_revision() == checkout
        return
    assert os.path.isfile(machine.RECORDED_REVISION), machine.RECORDED_REVISION
    rec = machine.recorded_revision()
    if rec is None:  # built from an sdist: the version stands in
        assert machine.source_revision().startswith("onnx_light_ep ")
    else:
        assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", rec), rec
        assert machine.source_revision() == rec


def test_blocks_are_kept_per_machine_kind(tmp_path):
    path = tmp_path / "B.md"
    zen4 = {"machine_kind": "AMD Zen 4 AVX-512", "isa": "avx512_bf16", "detected_isa": "avx512_bf16"}
    intel = {"machine_kind": "Intel Xeon (family 6 model 167) AVX-512", "isa": "avx512_bf16",
             "detected_isa": "avx512_bf16"}
    forced = {**zen4, "isa": "avx2"}
    path.write_text("# B\n\nnotes\n")
    report.update_block(str(path), "bench_x", "zen4 run 1", machine=zen4)
    report.update_block(str(path), "bench_y", "other", machine=zen4)
    report.update_block(str(path), "bench_x", "intel run", machine=intel)
    report.update_block(str(path), "bench_x", "zen4 run 2", machine=zen4)
    report.update_block(str(path), "bench_x", "zen4 at avx2", machine=forced)
    text = path.read_text()
    assert "zen4 run 1" not in text and text.count("zen4 run 2") == 1 and "intel run" in text
    assert text.startswith("# B\n\nnotes\n")
    # one block per machine kind, grouped: the Intel block right after the Zen 4 one, before bench_y
    order = [text.index(s) for s in ("zen4 run 2", "intel run", "zen4 at avx2", "other")]
    assert order == sorted(order)
    assert "<!-- bench_x[AMD Zen 4 AVX-512, ISA avx2]:end -->" in text


def _tiny(**kw):
    return bench.BenchConfig(4, 2, 1, 32, "float32", head_dim=16, num_layers=1, **kw)


def test_failed_configuration_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    real = decode.run_config

    def flaky(cfg, *a, **kw):
        if cfg.tag == "boom":
            raise RuntimeError("synthetic failure")
        return real(cfg, *a, **kw)

    monkeypatch.setattr(decode, "run_config", flaky)
    res = bench.run_bench([_tiny(tag="boom"), _tiny()], threads=(1,), quick=True, out_dir=str(tmp_path),
                          plot=False, candidates=("limit", "ep_kvcache"), progress=lambda s: None)
    on_disk = json.loads((tmp_path / "bench_decode.json").read_text())
    assert [r.get("failed") for r in on_disk["results"]] == ["RuntimeError: synthetic failure", None]
    assert on_disk["results"][1]["runs"][0]["candidates"]["ep_kvcache"]["status"] == "ok"
    assert "floor_ms" in on_disk["results"][1]["runs"][0]
    assert "FAILED: RuntimeError: synthetic failure" in report.markdown(res)


def test_failing_candidate_is_dropped_the_others_measured(tmp_path, monkeypatch):
    from onnx_light_ep.bench import candidates as cands

    def bad_step(self, threads):
        raise RuntimeError("step exploded")

    monkeypatch.setattr(cands.EpKVCacheBlock, "step", bad_step)
    res = bench.run_bench([_tiny()], threads=(1, 2), quick=True, out_dir=str(tmp_path), plot=False,
                          candidates=("limit", "ep_kvcache", "ep_kvcache_block"), progress=lambda s: None)
    for run in res["results"][0]["runs"]:
        c = run["candidates"]
        assert c["ep_kvcache_block"]["status"].startswith("error at round 0")
        assert "step exploded" in c["ep_kvcache_block"]["status"]
        assert "median_ms" not in c["ep_kvcache_block"]
        assert c["ep_kvcache"]["status"] == "ok" and c["ep_kvcache"]["median_ms"] > 0
    assert "step exploded" in report.markdown(res)


def test_reproducible_command_carries_the_forced_isa_level():
    from onnx_light_ep.bench.command import reproducible_command

    cmd = "python tools/bench_decode.py --out-dir bench_out"
    assert reproducible_command(cmd, {}) == cmd
    assert reproducible_command(cmd, {"ONNX_LIGHT_ISA": ""}) == cmd
    assert reproducible_command(cmd, {"ONNX_LIGHT_ISA": "avx2", "HOME": "/root"}) == "ONNX_LIGHT_ISA=avx2 " + cmd
    assert reproducible_command("ONNX_LIGHT_ISA=avx2 " + cmd, {"ONNX_LIGHT_ISA": "avx2"}) == "ONNX_LIGHT_ISA=avx2 " + cmd
    assert reproducible_command(cmd, {"ONNX_LIGHT_ISA": "a b"}) == "ONNX_LIGHT_ISA='a b' " + cmd


def test_bench_command_names_the_forced_isa_level(tmp_path, monkeypatch, capsys):
    """main_from_args hands run_bench (here a fake: the library's level is fixed once loaded, so
    the variable is not set for a real run) the command with ONNX_LIGHT_ISA in front."""
    import argparse

    from onnx_light_ep.bench import command as command_mod

    seen = {}

    def fake_run_bench(configs, **kw):
        seen["command"] = kw["command"]
        return {"settings": {"elapsed_s": 0.0}}

    monkeypatch.setattr(command_mod, "run_bench", fake_run_bench)
    monkeypatch.setenv("ONNX_LIGHT_ISA", "avx2")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--no-plot", "--out-dir", str(tmp_path)])
    assert bench.main_from_args(args, command="python tools/bench_decode.py --quick") == 0
    assert seen["command"] == "ONNX_LIGHT_ISA=avx2 python tools/bench_decode.py --quick"
