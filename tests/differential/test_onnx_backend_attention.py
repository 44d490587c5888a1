"""ONNX's own backend test cases for ``Attention``, run on the EP's tensor mode.

Cases: every one ``onnx.backend.test.case.node.collect_testcases("Attention")`` yields in the
installed onnx (the node cases and their ``_expanded`` twins, the operator's function body in
primitive ops), with the inputs and expected outputs the case ships. Each runs unconverted on
``onnx_light_ep.InferenceSession`` (tensor mode on, the default).

Tolerance: ONNX's backend runner's own comparison,
``onnx.backend.test.runner.Runner.assert_similar_outputs``, with the case's rtol/atol (every
Attention case: the node-case defaults rtol=1e-3, atol=1e-7): equal shapes and dtypes, then
``np.testing.assert_allclose`` (NaN and inf positions must match); bfloat16 outputs are compared
as float32 with rtol = max(rtol, 2**-6) (two bfloat16 ulps).

Placement, from ORT's profile (every node event of the run): an opset-23/24 ``Attention`` node
runs on OnnxLightExecutionProvider (bfloat16 and qk_matmul_output included); an opset-25 one
(windows, which the EP does not claim) and every ``_expanded`` model (no Attention node) run
entirely on ORT's CPU EP.

The five bfloat16 ``_expanded`` models hold no Attention node, so the EP claims nothing, and
ORT's CPU EP has no bfloat16 kernel for their Mul/Add/Expand nodes: no runtime here can open
them. ``test_bf16_expanded_models_open_on_neither_runtime`` asserts exactly that (session creation
raises NOT_IMPLEMENTED naming the op, on plain ORT and on the EP alike); an ORT that gains those
kernels fails it, and the cases then belong in ``test_backend_case_on_ep``.

A case whose Attention node the EP claims runs once per ISA level this CPU has (as every
differential test, tests/differential/conftest.py); the others never reach our kernels and run
once. Measuring both runtimes:
``python tests/differential/test_onnx_backend_attention.py`` prints each case's outcome on the
EP and on plain ORT and the counts.
"""
import json
import os
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnx.backend.test.runner import Runner

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, _TESTS)
if __name__ == "__main__":  # as a script: this tree's package, not an installed one
    sys.path.insert(0, os.path.join(_TESTS, os.pardir))
import onnx_light_ep  # noqa: E402
from onnx_light_ep import _core  # noqa: E402
from ort_utils import new_session_options, run  # noqa: E402

EP = onnx_light_ep.EP_NAME
CPU = "CPUExecutionProvider"
NOT_IMPLEMENTED = ort.capi.onnxruntime_pybind11_state.NotImplemented
_LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]  # as tests/differential/conftest.py
AVAILABLE_ISAS = _LEVELS[: _LEVELS.index(_core.detected_isa()) + 1]


def _collect():
    # collect_testcases imports every node-case module (their exports run even when filtered,
    # and some emit numpy warnings); only Attention cases are kept.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases
        cases = collect_testcases("Attention")
    nodes = {c.name for c in cases if any(n.op_type == "Attention" for n in c.model.graph.node)}
    return {c.name: c for c in cases
            if c.name in nodes or (c.name.endswith("_expanded") and c.name[: -len("_expanded")] in nodes)}


CASES = _collect()
NODE_CASES = sorted(n for n in CASES if not n.endswith("_expanded"))
assert len(NODE_CASES) >= 90, f"only {len(NODE_CASES)} Attention node cases collected"


def attention_opset(case):
    """The ai.onnx opset of a case's Attention node (the node case of an _expanded twin)."""
    base = CASES[case.name[: -len("_expanded")]] if case.name.endswith("_expanded") else case
    return next(o.version for o in base.model.opset_import if o.domain in ("", "ai.onnx"))


def _array(x):
    return numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x


def feeds_and_refs(case):
    (inputs, refs), = case.data_sets
    g = case.model.graph
    feeds = {vi.name: _array(x) for vi, x in zip(g.input, inputs)}
    return feeds, [o.name for o in g.output], [_array(r) for r in refs]


def run_case(case, session):
    """Runs the case's data set; raises AssertionError (Runner's message) if an output differs."""
    feeds, names, refs = feeds_and_refs(case)
    out = run(session, feeds, names)
    Runner.assert_similar_outputs(refs, [out[n] for n in names], rtol=case.rtol, atol=case.atol)


def node_providers(session):
    """Providers of every node ORT's profile records for the runs so far."""
    with open(session.end_profiling()) as f:
        events = json.load(f)
    return {e["args"]["provider"] for e in events if e.get("cat") == "Node" and "provider" in e.get("args", {})}


def expected_providers(case):
    expanded = case.name.endswith("_expanded")
    return {CPU} if expanded or attention_opset(case) not in (23, 24) else {EP}


def _is_bf16_expanded(name):
    return name.endswith("_expanded") and "_bf16" in name


@pytest.fixture(autouse=True)
def isa():
    """Replaces the directory's per-level fixture: test_backend_case_on_ep picks levels itself."""
    yield None


def _params():
    for name in sorted(CASES):
        if _is_bf16_expanded(name):
            continue  # opens on neither runtime: test_bf16_expanded_models_open_on_neither_runtime
        levels = AVAILABLE_ISAS if expected_providers(CASES[name]) == {EP} else [None]
        for level in levels:
            yield pytest.param(name, level, id=f"{name}-{level or 'ort-only'}")


@pytest.mark.parametrize("name, level", list(_params()))
def test_backend_case_on_ep(name, level, tmp_path):
    case = CASES[name]
    before = _core.isa()
    if level is not None:
        _core.set_isa(level)
    try:
        sess = onnx_light_ep.InferenceSession(case.model.SerializeToString(), new_session_options(tmp_path))
        run_case(case, sess)
    finally:
        _core.set_isa(before)
    assert node_providers(sess) == expected_providers(case)


def test_every_shipped_case_is_collected():
    """Each node case has its _expanded twin, and the bfloat16 ones are the five of the brief."""
    assert {n + "_expanded" for n in NODE_CASES} <= set(CASES)
    assert sorted(n for n in NODE_CASES if "_bf16" in n) == sorted([
        "test_attention_3d_causal_bf16", "test_attention_4d_attn_mask_causal_bf16", "test_attention_4d_causal_bf16",
        "test_attention_4d_causal_padded_kv_bf16", "test_attention_4d_padded_kv_bf16"])


@pytest.mark.parametrize("name", sorted(n for n in CASES if _is_bf16_expanded(n)))
def test_bf16_expanded_models_open_on_neither_runtime(name, tmp_path):
    """The bfloat16 function bodies (no Attention node): ORT's CPU EP lacks a bfloat16 kernel for
    one of their elementwise ops, so the session fails to open on plain ORT and, identically, with
    the EP (which claims nothing there)."""
    case = CASES[name]
    assert not any(n.op_type == "Attention" for n in case.model.graph.node)
    lacking = r"Could not find an implementation for (Mul|Add|Expand)\("
    with pytest.raises(NOT_IMPLEMENTED, match=lacking):
        ort.InferenceSession(case.model.SerializeToString(), providers=[CPU])
    with pytest.raises(NOT_IMPLEMENTED, match=lacking):
        onnx_light_ep.InferenceSession(case.model.SerializeToString(), new_session_options(tmp_path))


@pytest.mark.parametrize("name", ["test_attention_4d_with_past_and_present_qk_matmul_bias_3d_mask_causal",
                                  "test_attention_4d_with_past_and_present_qk_matmul_bias_4d_mask_causal"])
def test_qk_matmul_mode2_causal_expected_output_is_the_spec(name):
    """qk_matmul_output_mode=2 with is_causal=1 and a float attn_mask: the case's expected output is
    what the spec text says (opset 23: "If set to 2, qk_matmul_output includes the attention mask
    and softcap (if provided) applied to the output of qk matmul"; the bias is computed "based on
    attn_mask input and is_causal attribute", causal with bottom-right alignment, key j visible to
    query i iff j <= i + past_sequence_length, masked keys contributing -inf). So it is -inf at every
    causally masked key (ORT's CPU EP writes the lowest float there, hence its failure there)."""
    case = CASES[name]
    feeds, names, refs = feeds_and_refs(case)
    q, k, mask, past_k = feeds["Q"], feeds["K"], feeds["attn_mask"], feeds["past_key"]
    present_k = np.concatenate([past_k, k], axis=2).astype(np.float64)
    d = q.shape[-1]
    qk = q.astype(np.float64) @ present_k.transpose(0, 1, 3, 2) / np.sqrt(d)
    s, t, p = q.shape[2], present_k.shape[2], past_k.shape[2]
    causal = np.where(np.arange(t)[None, :] <= np.arange(s)[:, None] + p, 0.0, -np.inf)
    spec = qk + mask + causal
    expected = refs[names.index("qk_matmul_output")]
    assert np.array_equal(np.isneginf(expected), np.isneginf(spec)) and np.isneginf(spec).any()
    finite = np.isfinite(spec)
    np.testing.assert_allclose(expected[finite], spec[finite], rtol=1e-5, atol=1e-6)


def main():
    """Each case on the EP's tensor mode and on plain ORT; prints outcomes and counts."""
    import tempfile
    counts = {"EP": 0, "ORT": 0}
    tmp = tempfile.mkdtemp()
    for name in sorted(CASES):
        row = []
        for side in ("EP", "ORT"):
            try:
                so = new_session_options(tmp)
                model = CASES[name].model.SerializeToString()
                sess = (onnx_light_ep.InferenceSession(model, so) if side == "EP"
                        else ort.InferenceSession(model, so, providers=[CPU]))
                run_case(CASES[name], sess)
                row.append(f"{side} pass ({','.join(sorted(node_providers(sess)))})")
                counts[side] += 1
            except Exception as e:  # noqa: BLE001 - a report: every failure kind is printed
                row.append(f"{side} FAIL {type(e).__name__}: {str(e).strip().splitlines()[0][:100]}")
        print(name, "|", " | ".join(row))
    print(f"{len(CASES)} cases: pass on the EP {counts['EP']}, on plain ORT {counts['ORT']}")


if __name__ == "__main__":
    main()
