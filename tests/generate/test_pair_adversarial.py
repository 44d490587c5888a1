"""Prefill/decode pairs given the wrong way round: a folder whose prefill.onnx is the decode graph (pasts as
inputs) and decode.onnx the prefill graph (none). It converted, and generate then failed at step 0 inside
ORT ('Got invalid dimensions for input: position_ids'); now convert, generate and the CLI name the decode
graph's missing past and suggest the swap."""
import os
import shutil

import pytest

from onnx_light_ep.cli import main
from onnx_light_ep.generate import generate
from onnx_light_ep.rewrite import ConvertError, convert

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
WORDS = r"the decode graph's layer 0 has no past input \(pattern 'decomposed \(no past\)'\): a decode graph " \
        r"continues the cache the prefill graph started; expected decode.onnx to take the pasts \(are prefill.onnx " \
        r"and decode.onnx swapped\?\)"


@pytest.fixture
def swapped(tmp_path):
    folder = tmp_path / "swapped"
    folder.mkdir()
    src = os.path.join(DATA, "transformers_llama")
    shutil.copy(os.path.join(src, "decode.onnx"), folder / "prefill.onnx")
    shutil.copy(os.path.join(src, "prefill.onnx"), folder / "decode.onnx")
    return str(folder)


def test_convert_refuses_a_swapped_pair(swapped, tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(ConvertError, match=WORDS):
        convert(swapped, out)
    assert not os.path.exists(out)   # a failure leaves no output


def test_generate_refuses_a_swapped_pair_given_as_two_converted_graphs(swapped, tmp_path):
    p, d = str(tmp_path / "p.onnx"), str(tmp_path / "d.onnx")
    convert(os.path.join(swapped, "prefill.onnx"), p, stage="prefill")
    convert(os.path.join(swapped, "decode.onnx"), d, stage="decode")
    with pytest.raises(ValueError, match=WORDS):
        generate((p, d), prompt_ids=[[1, 2, 3]], max_new_tokens=2, threads=1)


def test_cli_says_so(swapped, tmp_path, capsys):
    assert main(["convert", swapped, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "are prefill.onnx and decode.onnx swapped?" in err and "Traceback" not in err
    assert main(["generate", swapped, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "-q"]) == 2
    err = capsys.readouterr().err
    assert "are prefill.onnx and decode.onnx swapped?" in err and "Traceback" not in err
