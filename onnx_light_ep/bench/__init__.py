"""Benchmarks (``onnx-light bench``), each a module with an importable ``run_*`` function:

- ``decode``: one decode step of every attention path (EP KVCache on pages and in one block,
  ORT's tensor and shared-buffer paths, the EP's tensor mode) against the read limit;
- ``arena``: the generation operations on the paged arena (beam search, fork, checkpoint /
  restore / truncate, sliding-window memory, page-table overhead);
- ``e2e``: end-to-end decode of a real model (SmolLM2-135M fp32 and int4) against plain ORT and
  onnxruntime-genai, with TTFT, the physical limit per context and a profiled prefill;
- ``prefill``: causal prefill attention of one layer, EP vs ORT Attention / GQA, against the
  compute floor.

``candidates``, ``models``, ``machine``, ``e2e_model`` and ``report`` are their building blocks;
every table states the machine kind, ISA level, read bandwidth, FMA peaks and source revision.
"""

from .command import add_arguments, main_from_args
from .decode import CANDIDATES, BenchConfig, default_configs, run_bench

__all__ = ["BenchConfig", "CANDIDATES", "add_arguments", "default_configs", "main_from_args", "run_bench"]
