"""convert on hostile inputs: unreadable files are ConvertErrors naming the path, tokenizer files
are copied only as regular files from inside the model's folder (never through a symlink), a
failing convert leaves nothing behind, and a rotary table whose declared dims disagree with its
data is refused."""
import os

import onnx
import pytest

import onnx_light_ep.rewrite._api as api
from onnx_light_ep.rewrite import ConvertError, convert

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
GENAI = os.path.join(DATA, "genai_llama_fp32.onnx")


@pytest.mark.parametrize("content", [os.urandom(4096), b"", open(GENAI, "rb").read()[:5000]],
                         ids=["random", "empty", "truncated"])
def test_unreadable_input_is_a_convert_error_naming_it(tmp_path, content):
    src = tmp_path / "bad.onnx"
    src.write_bytes(content)
    with pytest.raises(ConvertError, match="bad.onnx"):
        convert(src, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_tokenizer_files_only_regular_files_inside_the_folder(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    m = onnx.load(GENAI)
    onnx.save(m, model_dir / "model.onnx")
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    os.symlink(secret, model_dir / "tokenizer.json")
    (model_dir / "tokenizer_config.json").write_text("{}")
    out_dir = tmp_path / "out"
    report = convert(model_dir / "model.onnx", out_dir / "model.onnx")
    assert not (out_dir / "tokenizer.json").exists()
    assert (out_dir / "tokenizer_config.json").read_text() == "{}"
    assert any("copied tokenizer_config.json" in n and "tokenizer.json," not in n for n in report.notes), report.notes
    assert any("created the output folder" in n for n in report.notes)


def test_failed_convert_leaves_nothing(tmp_path, monkeypatch):
    def fail(src, dst):
        raise ConvertError("convert: the converted model fails onnx.checker: simulated")

    monkeypatch.setattr(api, "_check", fail)
    with pytest.raises(ConvertError, match="simulated"):
        convert(GENAI, tmp_path / "out.onnx")
    assert os.listdir(tmp_path) == []


def test_declared_rotary_dims_must_match_the_data(tmp_path):
    m = onnx.load(GENAI)
    gqa = next(n for n in m.graph.node if n.op_type == "GroupQueryAttention")
    cos = next(t for t in m.graph.initializer if t.name == gqa.input[7])
    cos.dims[0] = 1 << 40
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    with pytest.raises(ConvertError, match=r"declares dims \[1099511627776, "):
        convert(src, tmp_path / "out.onnx")


def test_cli_names_non_onnx_files_and_folders(tmp_path, capsys):
    from onnx_light_ep.cli import main

    junk = tmp_path / "junk.onnx"
    junk.write_bytes(os.urandom(2048))
    for argv, words in [
        (["convert", str(junk), "-o", str(tmp_path / "o.onnx")], "junk.onnx' is not a readable ONNX model"),
        (["convert", str(tmp_path), "-o", str(tmp_path / "o.onnx")], "(a folder)"),
        (["generate", str(junk), "--prompt-ids", "1"], "junk.onnx' is not a readable ONNX model"),
        (["compare", str(tmp_path), "-q"], "(a folder)"),
    ]:
        assert main(argv) == 2, argv
        assert words in capsys.readouterr().err, argv


def test_cli_usage_errors_exit_2_without_traceback(tmp_path, capsys):
    from onnx_light_ep.cli import main

    assert main(["demo", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens; expected >= 1" in capsys.readouterr().err
    assert main(["bench", "--config", "1,2,3", "--out-dir", str(tmp_path)]) == 2
    assert "--config: expected Hq,Hkv,B,L,dtype" in capsys.readouterr().err
    dst = str(tmp_path / "c.onnx")
    convert(GENAI, dst)
    assert main(["compare", dst, "-q"]) == 2
    assert "is already converted" in capsys.readouterr().err
    assert main(["convert", dst, "-o", str(tmp_path / "again.onnx")]) == 2
    err = capsys.readouterr().err
    n = sum(1 for x in onnx.load(dst, load_external_data=False).graph.node if x.op_type == "CacheAttention")
    assert f"is already converted: {n} CacheAttention node(s)" in err and "no attention" not in err


def test_external_data_through_a_symlink_is_a_clear_error(tmp_path):
    m = onnx.load(GENAI)
    src_dir = tmp_path / "real"
    src_dir.mkdir()
    onnx.save(m, src_dir / "model.onnx", save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(src_dir / "model.onnx.data", linked / "model.onnx.data")
    os.link(src_dir / "model.onnx", linked / "model.onnx")
    with pytest.raises(ConvertError, match="cp -L"):
        convert(linked / "model.onnx", tmp_path / "out" / "o.onnx")
    assert not (tmp_path / "out" / "o.onnx").exists()
