"""Gemma-3-270M (onnx_light_ep.models.gemma3), the second pretrained model, is OPT-IN (Gemma Terms
of Use): nothing is fetched or built without ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1. This checks the
refusal; the model itself is tested by tests/optin/test_gemma3_model.py, collected only with the
opt-in (tests/conftest.py)."""
import pytest

from onnx_light_ep.models import gemma3


@pytest.mark.parametrize("env", [None, "0", "yes"])
def test_build_refuses_without_the_acknowledgement(tmp_path, monkeypatch, env):
    if env is None:
        monkeypatch.delenv(gemma3.ACCEPT_ENV, raising=False)
    else:
        monkeypatch.setenv(gemma3.ACCEPT_ENV, env)
    cache = tmp_path / "cache"
    for call in (gemma3.ensure_gemma3_onnx, gemma3.ensure_gemma3_converted):
        with pytest.raises(gemma3.GemmaTermsNotAccepted, match=gemma3.ACCEPT_ENV):
            call(cache, progress=False)
    assert not cache.exists()  # nothing fetched, nothing written
    assert gemma3._main(["--cache-dir", str(cache)]) == 2
