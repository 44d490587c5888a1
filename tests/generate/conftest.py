"""Generation-loop tests: the mini decoders of tests/rewrite (rw_graphs, rw_harness) converted once per test."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rewrite"))

import rw_graphs as G  # noqa: E402
import rw_harness as H  # noqa: E402

MS = (("", 21), ("com.microsoft", 1))


@pytest.fixture
def mini_decoder(tmp_path):
    """``(original_path, converted_path)``: a 2-layer GroupQueryAttention decoder (vocab 50, rotary)."""
    def make(block=G.gqa_block, opsets=MS, name="m", **kw):
        src = H.save(G.decoder(block, layers=2, opsets=opsets, **kw), tmp_path / f"{name}.onnx")
        dst = str(tmp_path / f"{name}.light.onnx")
        from onnx_light_ep.rewrite import convert

        convert(src, dst)
        return src, dst
    return make
