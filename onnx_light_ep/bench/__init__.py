"""Benchmarks (``onnx-light bench``), each a module with an importable ``run_*`` function:

- ``decode``: one decode step of every attention path (EP KVCache on pages and in one block,
  ORT's tensor and shared-buffer paths, the EP's tensor mode) against the read limit;
- ``arena``: the generation operations on the paged arena (beam search, fork, checkpoint /
  restore / truncate, sliding-window memory, page-table overhead);
- ``e2e``: end-to-end decode of a real model against onnxruntime-genai.

``candidates``, ``models``, ``machine`` and ``report`` are their building blocks.
"""

from .decode import CANDIDATES, BenchConfig, add_arguments, default_configs, main_from_args, run_bench

__all__ = ["BenchConfig", "CANDIDATES", "add_arguments", "default_configs", "main_from_args", "run_bench"]
