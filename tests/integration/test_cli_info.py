"""`onnx-light --version`, `onnx-light info [--json]`, and an unknown ONNX_LIGHT_ISA value (reported
on stderr naming the levels; the best level is used). A level the CPU lacks takes the same path
(tests/cpp/test_attention.cc, isa_environment_values, with the best level given)."""
import json
import os
import subprocess
import sys

import pytest

import onnx_light_ep
from onnx_light_ep import _core
from onnx_light_ep.cli import main

LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"onnx-light {onnx_light_ep.__version__}"


def test_info_names_the_isa_levels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    supported = LEVELS[: LEVELS.index(_core.detected_isa()) + 1]
    assert f"attention ISA: {_core.isa()} (this CPU supports: {', '.join(supported)};" in out


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["version"] == onnx_light_ep.__version__
    assert info["attention_isa"] == _core.isa()
    assert info["isa_levels"] == LEVELS[: LEVELS.index(_core.detected_isa()) + 1]
    assert info["onnxruntime"]["version"] and any(d["ep_name"] == "OnnxLightExecutionProvider"
                                                  for d in info["ep_devices"])


def _run_with_isa(value):
    env = dict(os.environ, ONNX_LIGHT_ISA=value, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", "from onnx_light_ep import _core; print(_core.isa())"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def test_unknown_isa_environment_is_reported():
    best = _core.detected_isa()
    r = _run_with_isa("bogus")
    assert r.stdout.strip() == best
    assert "ONNX_LIGHT_ISA=bogus is not a level" in r.stderr and best in r.stderr
