"""Plain helpers shared by the tests (sessions, runs with bf16 support, profiling)."""
import ctypes
import glob
import json
import os

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from models import model_bytes
from reference import BF16

EP_NAME = "OnnxLightExecutionProvider"
CPU_EP = "CPUExecutionProvider"


def new_session_options(profile_dir=None):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if profile_dir is not None:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(str(profile_dir), "ortprof")
    return so


def make_ep_session(olep, model, sess_options=None, provider_options=None):
    """Session on OnnxLightExecutionProvider via the package."""
    sess = olep.InferenceSession(model_bytes(model), sess_options=sess_options,
                                 provider_options=provider_options)
    assert sess.get_providers()[0] == EP_NAME, sess.get_providers()
    return sess


def make_cpu_session(olep, model, sess_options=None):
    """Plain ORT CPU session with the custom-op library registered (exact path from the package)."""
    so = sess_options if sess_options is not None else new_session_options()
    so.register_custom_ops_library(olep.get_library_path())
    sess = ort.InferenceSession(model_bytes(model), so, providers=[CPU_EP])
    assert sess.get_providers() == [CPU_EP], sess.get_providers()
    return sess


def make_ort_session(model, sess_options=None):
    """Plain ORT CPU session, no custom ops (standard ONNX Attention side)."""
    so = sess_options if sess_options is not None else new_session_options()
    return ort.InferenceSession(model_bytes(model), so, providers=[CPU_EP])


def _is_bf16(a):
    return BF16 is not None and isinstance(a, np.ndarray) and a.dtype == BF16


def run(sess, feeds, output_names=None):
    """Run and return {name: ndarray}. bfloat16 arrays (ml_dtypes) in and out are supported
    (ORT's Python binding cannot convert them itself)."""
    names = output_names or [o.name for o in sess.get_outputs()]
    if not any(_is_bf16(v) for v in feeds.values()) and not any(
            o.type == "tensor(bfloat16)" for o in sess.get_outputs() if o.name in names):
        return dict(zip(names, sess.run(names, feeds)))
    binding = sess.io_binding()
    for k, v in feeds.items():
        if _is_bf16(v):
            ov = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(v).view(np.uint16), TensorProto.BFLOAT16)
        else:
            ov = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v))
        binding.bind_ortvalue_input(k, ov)
    for n in names:
        binding.bind_output(n)
    sess.run_with_iobinding(binding)
    out = {}
    for n, ov in zip(names, binding.get_outputs()):
        if ov.data_type() == "tensor(bfloat16)":
            shape = tuple(ov.shape())
            cnt = int(np.prod(shape))
            if cnt:
                buf = (ctypes.c_uint16 * cnt).from_address(ov.data_ptr())
                arr = np.frombuffer(buf, dtype=np.uint16).copy()
            else:
                arr = np.zeros(0, np.uint16)
            out[n] = arr.view(BF16).reshape(shape)
        else:
            out[n] = ov.numpy()
    return out


def providers_from_profile(profile_path, op_type):
    """Set of providers that executed nodes whose op_name == op_type in an ORT profile trace.

    OnnxLightExecutionProvider runs every node it claims as a fused single-node graph, which the
    profile names ``OnnxLightExecutionProvider_<hash>_<n>`` (no op type): those events count as
    ``op_type``, so use graphs in which the EP can claim no other kind of node than ``op_type``
    (and the cache ops around it) when asking which provider ran it."""
    with open(profile_path) as f:
        events = json.load(f)
    found = set()
    for ev in events:
        if ev.get("cat") != "Node":
            continue
        args = ev.get("args", {})
        name = args.get("op_name", "")
        if (name == op_type or name.startswith("OnnxLightExecutionProvider_")) and "provider" in args:
            found.add(args["provider"])
    return found


def end_profile_providers(sess, op_type):
    return providers_from_profile(sess.end_profiling(), op_type)


def providers_that_ran(session_factory, feeds, op_type, profile_dir):
    """Create a session with profiling on (``session_factory(sess_options)``), run ``feeds``
    (a dict, a list of dicts, or a callable taking the session), and return the set of
    providers that ran nodes of ``op_type``."""
    so = new_session_options(profile_dir)
    sess = session_factory(so)
    if callable(feeds):
        feeds(sess)
    else:
        for fd in ([feeds] if isinstance(feeds, dict) else feeds):
            run(sess, fd)
    return end_profile_providers(sess, op_type)
