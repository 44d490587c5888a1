"""Fixtures for onnx-light-ep tests. Helpers live in ort_utils.py / reference.py / models.py."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ort_utils  # noqa: E402

# tests/optin holds the Gemma-3-270M model tests: collected only when the Gemma Terms of Use are
# accepted (ONNX_LIGHT_ACCEPT_GEMMA_TERMS=1, onnx_light_ep.models.gemma3); otherwise not part of
# the run at all (neither run nor reported as skipped).
from onnx_light_ep.models.gemma3 import gemma_terms_accepted  # noqa: E402

collect_ignore = [] if gemma_terms_accepted() else ["optin"]


@pytest.fixture(scope="session")
def olep():
    """The package under test. Import failure is an error, not a skip."""
    import onnx_light_ep

    return onnx_light_ep


@pytest.fixture
def ep_session(olep):
    """ep_session(model, sess_options=None, provider_options=None) -> onnx_light_ep.InferenceSession"""
    def make(model, sess_options=None, provider_options=None):
        return ort_utils.make_ep_session(olep, model, sess_options, provider_options)
    return make


@pytest.fixture
def cpu_session(olep):
    """cpu_session(model, sess_options=None) -> ORT CPU session with the custom-op library."""
    def make(model, sess_options=None):
        return ort_utils.make_cpu_session(olep, model, sess_options)
    return make


@pytest.fixture
def ort_session():
    """ort_session(model) -> plain ORT CPU session (no custom ops)."""
    return ort_utils.make_ort_session


@pytest.fixture
def providers_that_ran(tmp_path):
    """providers_that_ran(session_factory, feeds, op_type) -> set of provider names."""
    def f(session_factory, feeds, op_type):
        return ort_utils.providers_that_ran(session_factory, feeds, op_type, tmp_path)
    return f


@pytest.fixture
def make_cache(olep):
    """make_cache(*args, **kw) -> KVCache, closed at teardown."""
    caches = []

    def make(*args, **kw):
        c = olep.KVCache(*args, **kw)
        caches.append(c)
        return c

    yield make
    for c in caches:
        c.close()
