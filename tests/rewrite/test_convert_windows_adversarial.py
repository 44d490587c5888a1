"""Sliding windows from hostile options and config.json files: convert either writes a model whose caches the
arena can make, or refuses with a ConvertError naming the option; a config.json window is never trusted beyond
what a cache can hold."""
import json

import pytest

import rw_graphs as G
import rw_harness as H
from onnx_light_ep import KVCache
from onnx_light_ep.cli import main
from onnx_light_ep.rewrite import ConvertError, convert, read_metadata

MS = (("", 21), ("com.microsoft", 1))


def _model(tmp_path, config=None):
    src = H.save(G.decoder(G.gqa_block, layers=2, opsets=MS), tmp_path / "m.onnx")
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return src


@pytest.mark.parametrize("window", [True, False, 2 ** 24 + 1, 2 ** 40, 2 ** 70, "8", 8.0])
def test_a_bad_sliding_window_option_is_refused(tmp_path, window):
    """True was taken as a window of 1 token and 2**40 wrote a model KVCache.for_model then refused."""
    src = _model(tmp_path)
    with pytest.raises(ConvertError, match=r"convert: sliding_window; expected a positive int <= 16777216 \(the "
                                           r"longest sequence a KVCache holds\) or None, got"):
        convert(src, str(tmp_path / "o.onnx"), sliding_window=window)


def test_the_largest_window_option_converts_and_runs(tmp_path):
    src = _model(tmp_path)
    dst = str(tmp_path / "o.onnx")
    convert(src, dst, sliding_window=2 ** 24)
    assert [x["local_window_size"] for x in read_metadata(dst)["layers"]] == [2 ** 24] * 2
    KVCache.for_model(dst, 1, 64).close()


def test_cli_refuses_a_huge_window(tmp_path, capsys):
    src = _model(tmp_path)
    assert main(["convert", src, "-o", str(tmp_path / "o.onnx"), "--sliding-window", str(2 ** 40)]) == 2
    err = capsys.readouterr().err
    assert "error: convert: sliding_window; expected a positive int <= 16777216" in err and "Traceback" not in err


@pytest.mark.parametrize("window", [2 ** 24 + 1, 2 ** 40, 2 ** 63 - 1, 2 ** 64])
def test_a_config_window_beyond_any_sequence_is_full_attention(tmp_path, window):
    """A config.json window longer than any cache can hold changes no output: it is no window (it wrote a model
    for_model refused, or failed with 'Value out of range' past int64)."""
    src = _model(tmp_path, {"model_type": "mistral", "sliding_window": window, "num_hidden_layers": 2})
    dst = str(tmp_path / "o.onnx")
    convert(src, dst)
    assert [x["local_window_size"] for x in read_metadata(dst)["layers"]] == [-1, -1]
    KVCache.for_model(dst, 1, 64).close()


def test_a_config_window_within_the_limit_is_applied(tmp_path):
    src = _model(tmp_path, {"model_type": "mistral", "sliding_window": 2 ** 24, "num_hidden_layers": 2})
    dst = str(tmp_path / "o.onnx")
    convert(src, dst)
    assert [x["local_window_size"] for x in read_metadata(dst)["layers"]] == [2 ** 24] * 2
    KVCache.for_model(dst, 1, 64).close()
