"""Markdown table and PNG plot of a ``run_bench`` result (see ``decode.py``).

``markdown(result)`` returns the report text: machine, command, then one table
per (layers kind, thread count); rows are configurations, columns each
candidate's median ms per step, the EP's ratio to the limit and its speedup
over ORT's best equivalent-contract path. ``plot(result, path)`` writes step
latency vs context length per candidate (multi-layer, 1 thread, one panel per
head layout and dtype, B=1) and returns the path, or ``None`` when matplotlib
is missing.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from typing import Dict, List, Optional

SHORT = {"limit": "limit", "ort_attention_past": "ORT Attn past", "ort_gqa_shared": "ORT GQA shared",
         "ort_tensor_scatter": "ORT TS+Attn24", "ep_attention_past": "EP tensor",
         "ep_kvcache": "EP KVCache", "ep_kvcache_block": "EP one block", "ep_kvcache_4k": "EP 4 KiB pages"}
_ORDER = ("limit", "ort_attention_past", "ort_gqa_shared", "ort_tensor_scatter", "ep_attention_past",
          "ep_kvcache", "ep_kvcache_block", "ep_kvcache_4k")
_DT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_COLORS = {"limit": "black", "ort_attention_past": "tab:orange", "ort_gqa_shared": "tab:green",
           "ort_tensor_scatter": "tab:red", "ep_attention_past": "tab:purple", "ep_kvcache": "tab:blue",
           "ep_kvcache_block": "tab:cyan", "ep_kvcache_4k": "tab:gray"}


def _cell(entry: Optional[Dict]) -> str:
    if not entry:
        return ""
    if entry.get("median_ms") is None:
        s = entry.get("status", "")
        if s.startswith("unsupported"):
            return "n/s"
        if s.startswith("not claimed"):
            return "not claimed"
        if s.startswith("skipped"):
            return "skip (mem)"
        return "error"
    m, lo, hi = entry["median_ms"], entry["p25_ms"], entry["p75_ms"]
    fmt = "{:.3g}" if m < 10 else "{:.0f}"
    return f"{fmt.format(m)} [{fmt.format(lo)}–{fmt.format(hi)}]"


def _ratio(x: Optional[float], suffix: str = "") -> str:
    return "" if x is None else f"{x:.2f}{suffix}"


def _row(rec: Dict, run: Dict) -> str:
    c = rec["config"]
    ep = run["candidates"].get("ep_kvcache", {})
    best = run.get("ort_best")
    name = rec["name"].split(" x")[0]
    for long, short in _DT.items():
        name = name.replace(" " + long, " " + short)
    cells = [name,
             str(c["num_layers"]), f"{rec['working_set_bytes'] / 2**20:.0f}"]
    cells += [_cell(run["candidates"].get(k)) for k in _ORDER]
    cells += [_fmt(run.get("compute_ms"), ".3g"), _floor_cell(run)]
    cells += [_ratio(ep.get("x_limit")), _ratio(ep.get("x_floor")), _ratio(run.get("paged_vs_block")),
              _ratio(ep.get("speedup_vs_ort_best"), "x") +
              (f" ({SHORT[best].replace('ORT ', '')})" if best and ep.get("speedup_vs_ort_best") else ""),
              _bytes_cell(ep)]
    return "| " + " | ".join(cells) + " |"


def _floor_cell(run: Dict) -> str:
    """floor ms with R (read-bound: the limit) or C (compute-bound) after it."""
    f = run.get("floor_ms")
    if f is None:
        return ""
    return f"{f:.3g} {'C' if run.get('bound') == 'compute' else 'R'}"


def _bytes_cell(ep: Dict) -> str:
    a, c = ep.get("bytes_appended_per_step"), ep.get("bytes_copied_per_step")
    if a is None:
        return ""
    return f"{a / 1024:.0f} KiB / {c:.0f}"


def _table(rows: List[str]) -> List[str]:
    head = (["config", "layers", "K+V MiB/step"] + [SHORT[k] + " ms" for k in _ORDER] +
            ["compute ms", "floor ms", "EP ÷ limit", "EP ÷ floor", "paged ÷ one block", "EP speedup vs ORT best", "EP appended / copied per step"])
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + rows


_PEAK_NAMES = {"fp32_avx2": "fp32 FMA AVX2", "fp32_avx512": "fp32 FMA AVX-512",
               "bf16_avx512bf16": "bf16 dot AVX512-BF16", "int16_avx2": "int16 dot AVX2",
               "int16_avx512bw": "int16 dot AVX-512BW", "int16_avx512vnni": "int16 dot AVX512-VNNI"}


def peaks_text(peaks: Optional[Dict]) -> str:
    """``fp32 FMA AVX2 58.4, fp32 FMA AVX-512 111.3, ...`` (n/a where the CPU lacks a level)."""
    if not peaks:
        return "not measured"
    return ", ".join(f"{_PEAK_NAMES.get(k, k)} {'n/a' if v is None else f'{v:.1f}'}" for k, v in peaks.items())


def machine_lines(m: Dict) -> List[str]:
    """The header every generated table carries: machine kind and model, ISA level in use, read
    bandwidth, FMA peaks and the source revision it was measured with."""
    caches = ", ".join(f"{k} {v}" for k, v in m.get("lscpu_caches", {}).items())
    bw = m.get("stream_read_gb_per_s")
    isa = m.get("isa")
    forced = f", detected `{m.get('detected_isa')}`" if m.get("detected_isa") not in (None, isa) else ""
    return [
        f"- machine: {m.get('machine_kind', '?')}; CPU: {m.get('cpu_model')} ({m.get('num_cpus')} vCPUs, "
        f"{m.get('threads_per_core')} thread/core, hypervisor {m.get('hypervisor')}); "
        f"flags: {', '.join(m.get('cpu_flags', []))}",
        f"- attention ISA level in use: `{isa}`{forced}",
        f"- caches: {caches}; LLC used for planning: {(m.get('llc_bytes') or 0) / 2**20:.0f} MiB",
        f"- memory: {(m.get('mem_total_bytes') or 0) / 2**30:.1f} GiB; stream_read bandwidth "
        + (f"{bw.get('1')} GB/s (1 thread), {bw.get('2')} GB/s (2 threads)" if bw else "not measured")
        + f"; one-core multiply-add peak (`_core.fma_peak`, GFMA/s): {peaks_text(m.get('fma_peak_gfma_per_s'))}",
        f"- software: source {m.get('source_revision', '?')}, onnxruntime {m.get('onnxruntime')}, "
        f"onnx_light_ep {m.get('onnx_light_ep')}, numpy {m.get('numpy')}, Python {m.get('python')}, "
        f"{m.get('platform')}",
    ]


def _median(rec_run: Dict, key: str) -> Optional[float]:
    return (rec_run["candidates"].get(key) or {}).get("median_ms")


def _geomean(xs: List[float]) -> Optional[float]:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary(result: Dict) -> Dict:
    """Headline rows and the thread / dtype ratios, computed from the runs (JSON-able)."""
    multi = [r for r in result["results"] if not r.get("skipped") and not r.get("failed")
             and not r["config"].get("tag")]
    head, threads, dtypes = [], {}, []
    by_shape: Dict[tuple, Dict[str, Dict]] = {}
    for rec in multi:
        c = rec["config"]
        runs = {run["threads"]: run for run in rec["runs"]}
        if 1 in runs:
            by_shape.setdefault((c["q_num_heads"], c["kv_num_heads"], c["batch_size"],
                                 c["context_length"]), {})[c["dtype"]] = runs[1]
        if 1 in runs and c["context_length"] >= 4096 and c["dtype"] in ("float32", "float16"):
            run = runs[1]
            ep = run["candidates"].get("ep_kvcache") or {}
            best = run.get("ort_best")
            head.append({"name": rec["name"], "layers": c["num_layers"],
                         "working_set_mib": rec["working_set_bytes"] / 2**20,
                         "limit_ms": _median(run, "limit"), "ep_kvcache_ms": ep.get("median_ms"),
                         "compute_ms": run.get("compute_ms"), "floor_ms": run.get("floor_ms"),
                         "bound": run.get("bound"), "ep_x_floor": ep.get("x_floor"),
                         "ep_x_limit": ep.get("x_limit"), "ort_best": best,
                         "ort_best_ms": _median(run, best) if best else None,
                         "ort_best_x_limit": (run["candidates"][best].get("x_limit") if best else None),
                         "ep_speedup_vs_ort_best": ep.get("speedup_vs_ort_best"),
                         "ep_tensor_ms": _median(run, "ep_attention_past"),
                         "ort_attention_past_ms": _median(run, "ort_attention_past"),
                         "bytes_appended_per_step": ep.get("bytes_appended_per_step"),
                         "bytes_copied_per_step": ep.get("bytes_copied_per_step")})
        if 1 in runs and 2 in runs:
            for k in _ORDER:
                a, b = _median(runs[1], k), _median(runs[2], k)
                if a and b:
                    threads.setdefault(k, []).append(a / b)
    for shape, per in sorted(by_shape.items()):
        if "float32" not in per:
            continue
        row = {"shape": "Hq={} Hkv={} B={} L={}".format(*shape)}
        for dt in ("float16", "bfloat16"):
            if dt in per:
                for k in ("limit", "ep_kvcache", "ort_gqa_shared"):
                    # per layer: the multi-layer plans of fp16/bf16 may cycle twice the layers
                    a = (per[dt]["candidates"].get(k) or {}).get("per_layer_median_ms")
                    b = (per["float32"]["candidates"].get(k) or {}).get("per_layer_median_ms")
                    row[f"{k}_{_DT[dt]}_over_fp32"] = a / b if a and b else None
        dtypes.append(row)
    return {"headline_1thread_multilayer_L4k_plus": head,
            "speedup_2_threads_over_1_geomean": {k: _geomean(v) for k, v in threads.items()},
            "speedup_2_threads_over_1_range": {k: [min(v), max(v)] for k, v in threads.items()},
            "dtype_time_ratios_1thread_multilayer": dtypes,
            "dtype_time_ratio_geomean": {
                key: _geomean([r.get(key) for r in dtypes])
                for key in sorted({k for r in dtypes for k in r if k != "shape"})}}


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def summary_lines(sm: Dict) -> List[str]:
    if not sm["headline_1thread_multilayer_L4k_plus"]:
        lines = ["### Headline: none (this run has no 1-thread multi-layer configuration with L >= 4K; "
                 "the full tables follow)", ""]
        return lines + _ratio_lines(sm)
    lines = ["### Headline: 1 thread, multi-layer (K+V >= 3x LLC where possible), L >= 4K", "",
             "| config | layers | K+V MiB | limit ms | compute ms | floor ms | EP KVCache ms | EP ÷ limit "
             "| EP ÷ floor | ORT best ms (path) | ORT best ÷ limit | EP speedup vs ORT best | ORT Attn past ms "
             "| EP tensor ms | EP appended / copied per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for h in sm["headline_1thread_multilayer_L4k_plus"]:
        best = SHORT.get(h["ort_best"] or "", "").replace("ORT ", "")
        name = h["name"].split(" x")[0]
        for long, short in _DT.items():
            name = name.replace(" " + long, " " + short)
        lines.append(
            f"| {name} | {h['layers']} | {h['working_set_mib']:.0f} | {_fmt(h['limit_ms'], '.3g')} | "
            f"{_fmt(h.get('compute_ms'), '.3g')} | {_floor_cell(h)} | "
            f"{_fmt(h['ep_kvcache_ms'], '.3g')} | {_fmt(h['ep_x_limit'])} | {_fmt(h.get('ep_x_floor'))} | "
            f"{_fmt(h['ort_best_ms'], '.3g')} ({best}) | {_fmt(h['ort_best_x_limit'])} | "
            f"{_fmt(h['ep_speedup_vs_ort_best'])}x | {_fmt(h['ort_attention_past_ms'], '.3g')} | "
            f"{_fmt(h['ep_tensor_ms'], '.3g')} | "
            f"{_bytes_cell({'bytes_appended_per_step': h['bytes_appended_per_step'], 'bytes_copied_per_step': h['bytes_copied_per_step']})} |")
    return lines + [""] + _ratio_lines(sm)


def _ratio_lines(sm: Dict) -> List[str]:
    lines = ["2 threads vs 1 thread (median(1 thread) / median(2 threads), geometric mean over "
              "multi-layer configurations [min–max]): " + ", ".join(
                  f"{SHORT[k]} {_fmt(v)} [{_fmt(sm['speedup_2_threads_over_1_range'][k][0])}–"
                  f"{_fmt(sm['speedup_2_threads_over_1_range'][k][1])}]"
                  for k, v in sm["speedup_2_threads_over_1_geomean"].items() if v), ""]
    g = sm["dtype_time_ratio_geomean"]
    lines += ["Time per layer fp16 / fp32 and bf16 / fp32 (1 thread, multi-layer, geometric mean over "
              "(heads, B, L); 0.5 = the halved bytes fully turned into time): " + ", ".join(
                  f"{k.replace('_over_fp32', '').replace('_', ' ')} {_fmt(v)}" for k, v in g.items() if v), ""]
    return lines


def grid_markdown(result: Dict) -> str:
    """The attention-step part: machine, command, headline, ratios, full tables."""
    s = result["settings"]
    lines = ["## Decode step: latency per step (all layers), median [p25–p75] ms", ""]
    lines += machine_lines(result["machine"])
    lines += ["", f"Command: `{s.get('command') or 'onnx-light bench'}`"
              + f" (source {_source(result)})  ",
              f"{s['warmup']} warm-up + {s['reps']} measured steps per candidate and thread count, "
              f"interleaved round-robin in one process; threads = `intra_op_num_threads` "
              f"(ORT spinning {'on' if s.get('allow_spinning') else 'off'}); D = 128; "
              f"run took {s.get('elapsed_s', 0) / 60:.1f} min.", ""]
    lines += summary_lines(result.get("summary") or summary(result))
    groups: Dict[tuple, List[str]] = {}
    skipped, failed = [], []
    for rec in result["results"]:
        if rec.get("skipped"):
            skipped.append(f"- {rec['name']}: {rec['skipped']}")
            continue
        if rec.get("failed"):
            failed.append(f"- {rec['name']}: FAILED: {rec['failed']}")
            continue
        for run in rec["runs"]:
            for k, v in run["candidates"].items():
                st = v.get("status", "ok")
                if st.startswith("error"):
                    failed.append(f"- {rec['name']}, {SHORT.get(k, k)}, {run['threads']} thread(s): {st}")
        tag = rec["config"].get("tag") or "multi-layer"
        for run in rec["runs"]:
            groups.setdefault((tag, run["threads"]), []).append(_row(rec, run))
    for (tag, t), rows in sorted(groups.items(), key=lambda x: (x[0][0] != "multi-layer", x[0])):
        lines += [f"### {tag}, {t} thread{'s' if t > 1 else ''}", ""] + _table(rows) + [""]
    if failed:
        lines += ["Failed (the rest of the run is kept):", ""] + sorted(set(failed), key=failed.index) + [""]
    if skipped:
        lines += ["Skipped configurations:", ""] + skipped + [""]
    lines += ["Legend: `n/s` not supported by ORT's CPU kernels (bf16); `skip (mem)` over the memory "
              "budget; `not claimed` = the EP did not take the standard Attention node (ORT profile), "
              "so no time is reported under the EP's name. `EP ÷ limit` = EP KVCache median / "
              "stream_read of the same K+V bytes in the same run (1.00 = at the physical limit). "
              "`compute ms` = the step's multiply-adds (per key and query row: head_dim for q.k + "
              "v_head_dim for P.V) at the measured one-core peak of the ISA level in use (fp32 FMA at "
              "the level's width; q.k at the bf16 pair-dot peak where avx512_bf16 runs bf16 K through "
              "VDPBF16PS: >= 3 query rows per KV head), split "
              "over the threads; `floor ms` = max(limit, compute ms), R = read-bound, C = compute-bound; "
              "`EP ÷ floor` = EP KVCache median / floor. "
              "`EP speedup vs ORT best` = faster of ORT GQA shared buffer and ORT TensorScatter "
              "+ Attention(opset 24) divided by EP KVCache.", ""]
    return "\n".join(lines)


def e2e_markdown(result: Dict) -> str:
    """The end-to-end part (SmolLM2-135M tokens/s), with its command."""
    from .e2e import markdown_lines

    s = result["settings"]
    return "\n".join(["## End to end", ""] + machine_lines(result["machine"]) + [""] +
                     markdown_lines(result["end_to_end"]) +
                     [f"Command: `{s.get('command') or 'onnx-light bench --e2e'}` (source {_source(result)}).", ""])


def _source(result: Dict) -> str:
    md = (result.get("settings") or {}).get("metadata") or {}
    return md.get("source_revision") or result.get("machine", {}).get("source_revision") or "?"


def markdown(result: Dict) -> str:
    """Everything of ``result`` (written to ``bench_decode.md``)."""
    parts = [grid_markdown(result)] if result["results"] else []
    if result.get("end_to_end"):
        parts.append(e2e_markdown(result))
    return "\n".join(parts)


def plot(result: Dict, path: str) -> Optional[str]:
    """Step latency vs context length per candidate (1 thread, multi-layer, B=1); PNG path or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    series: Dict[tuple, Dict[str, List[tuple]]] = {}
    for rec in result["results"]:
        c = rec["config"]
        if rec.get("skipped") or c.get("tag") or c["batch_size"] != 1:
            continue
        for run in rec["runs"]:
            if run["threads"] != 1:
                continue
            panel = series.setdefault((c["q_num_heads"], c["kv_num_heads"], c["dtype"]), {})
            for k, v in run["candidates"].items():
                if v.get("median_ms") is not None:
                    panel.setdefault(k, []).append((c["context_length"], v["median_ms"] / c["num_layers"]))
    if not series:
        return None
    keys = sorted(series, key=lambda x: (-x[1], ["float32", "float16", "bfloat16"].index(x[2])))
    ncol = min(3, len(keys))
    nrow = (len(keys) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.2 * nrow), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for k in _ORDER:
            pts = sorted(series[key].get(k, []))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=SHORT[k],
                        ls="--" if k == "limit" else "-", color=_COLORS[k])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"Hq={key[0]} Hkv={key[1]} {_DT[key[2]]}, B=1", fontsize=9)
        ax.set_xlabel("context length", fontsize=8)
        ax.set_ylabel("ms per layer-step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=len(handles),
               fontsize=8, frameon=False)
    fig.suptitle("Decode step latency per layer (multi-layer working set, 1 thread)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=64)
    plt.close(fig)
    return path


_MARK = "<!-- {}:{} (generated by onnx-light bench --benchmarks-md; edits inside are lost) -->"


def machine_key(machine: Optional[Dict]) -> Optional[str]:
    """The per-machine key of a generated block: the machine kind (``machine.machine_kind``), plus
    the ISA level when it was forced below the detected one (``AMD Zen 4 AVX-512, ISA avx2``)."""
    if not machine or not machine.get("machine_kind"):
        return None
    key = machine["machine_kind"]
    if machine.get("isa") and machine.get("detected_isa") and machine["isa"] != machine["detected_isa"]:
        key += f", ISA {machine['isa']}"
    return key.replace("[", "(").replace("]", ")").replace("--", "-")


def block_name(base: str, machine: Optional[Dict]) -> str:
    """``base[machine key]`` (or ``base`` without a machine): one block per base and machine kind."""
    key = machine_key(machine)
    return f"{base}[{key}]" if key else base


def _replace_block(text: str, name: str, body: str) -> str:
    """Replace block ``name``; a new ``base[key]`` block goes right after the last block of the
    same base (other machines' runs of that benchmark), else at the end."""
    begin, end = _MARK.format(name, "begin"), f"<!-- {name}:end -->"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        return re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda m: block, text, flags=re.S)
    base = name.split("[", 1)[0]
    ends = list(re.finditer(r"<!-- " + re.escape(base) + r"(\[[^\]]*\])?:end -->", text))
    if ends:
        at = ends[-1].end()
        return text[:at] + "\n\n" + block + text[at:]
    return (text or "# Benchmarks\n\n") + "\n" + block + "\n"


def update_benchmarks_md(path: str, result: Dict, png: Optional[str] = None) -> None:
    """Replace this machine kind's generated blocks of ``path`` (created if missing) with this run's.

    Block ``bench_decode[<machine key>]`` holds :func:`grid_markdown` (only if the run has grid
    results), block ``bench_e2e[<machine key>]`` :func:`e2e_markdown` (only if it has an
    end-to-end part); other machines' blocks and text outside the blocks (hand-written notes)
    are kept. ``png``, if it exists, is copied to ``docs/bench_decode-<machine key>.png`` beside
    ``path`` and linked from the grid block.
    """
    text = ""
    if os.path.isfile(path):
        with open(path) as f:
            text = f.read()
    machine = result.get("machine")
    if result["results"]:
        body = grid_markdown(result)
        if png and os.path.isfile(png):
            docs = os.path.join(os.path.dirname(os.path.abspath(path)), "docs")
            os.makedirs(docs, exist_ok=True)
            slug = re.sub(r"[^A-Za-z0-9]+", "-", machine_key(machine) or "").strip("-").lower()
            name = f"bench_decode-{slug}.png" if slug else "bench_decode.png"
            shutil.copyfile(png, os.path.join(docs, name))
            body += f"\n![step latency vs context](docs/{name})\n"
        text = _replace_block(text, block_name("bench_decode", machine), body)
    if result.get("end_to_end"):
        text = _replace_block(text, block_name("bench_e2e", machine), e2e_markdown(result))
    with open(path, "w") as f:
        f.write(text)


def update_block(path: str, name: str, body: str, machine: Optional[Dict] = None) -> None:
    """Replace generated block ``name`` (``name[<machine key>]`` when ``machine`` is given: one
    block per machine kind) of ``path`` (created if missing) with ``body``."""
    text = ""
    if os.path.isfile(path):
        with open(path) as f:
            text = f.read()
    with open(path, "w") as f:
        f.write(_replace_block(text, block_name(name, machine), body))


def update_benchmarks_md_section(path: str, name: str, arena: Dict) -> None:
    """Replace block ``bench_<name>[<machine key>]`` of ``path`` with the arena report (bench/arena.py)."""
    from .arena import markdown as arena_markdown

    s = arena["settings"]
    body = ["## Generation operations on the paged arena", ""] + machine_lines(arena["machine"]) + [
        "", f"Command: `{s.get('command') or 'onnx-light bench --arena-only'}`; run took "
        f"{s.get('elapsed_s', 0) / 60:.1f} min.", ""] + arena_markdown(arena)
    update_block(path, "bench_" + name, "\n".join(body), machine=arena["machine"])
