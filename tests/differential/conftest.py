"""Every differential test runs once per attention-kernel ISA level (scalar oracle, AVX2,
AVX-512, AVX-512 with VDPBF16PS/VNNI), forced through ``onnx_light_ep._core.set_isa``.
A level this CPU lacks is reported as skipped with the reason ("avx512: not supported by this
CPU, ...") rather than left out, so a run on an AVX2-only machine shows what it did not cover."""
import pytest

from onnx_light_ep import _core

_LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]
AVAILABLE_ISAS = _LEVELS[: _LEVELS.index(_core.detected_isa()) + 1]


@pytest.fixture(autouse=True, params=_LEVELS)
def isa(request):
    if request.param not in AVAILABLE_ISAS:
        pytest.skip(f"{request.param}: not supported by this CPU (it offers {', '.join(AVAILABLE_ISAS)})")
    before = _core.isa()
    _core.set_isa(request.param)
    yield request.param
    _core.set_isa(before)
