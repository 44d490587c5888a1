"""Every differential test runs once per attention-kernel ISA level this CPU has
(scalar oracle, AVX2, AVX-512, AVX-512 with VDPBF16PS for bfloat16 q.k), forced through
``onnx_light_ep._core.set_isa``.
Levels the CPU lacks are not generated (the machine cannot run them)."""
import pytest

from onnx_light_ep import _core

_LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]
AVAILABLE_ISAS = _LEVELS[: _LEVELS.index(_core.detected_isa()) + 1]


@pytest.fixture(autouse=True, params=AVAILABLE_ISAS)
def isa(request):
    before = _core.isa()
    _core.set_isa(request.param)
    yield request.param
    _core.set_isa(before)
