"""TextTokenizer.find loads a folder's tokenizer once and reuses it while its files are unchanged;
a changed tokenizer.json or config is loaded again."""
import json
import os

from onnx_light_ep._text import TextTokenizer


def _save(d, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))


def test_reused_while_unchanged_reloaded_when_changed(tmp_path):
    _save(tmp_path, {"<unk>": 0, "a": 1, "b": 2})
    first = TextTokenizer.find([str(tmp_path)])
    assert TextTokenizer.find([str(tmp_path)]) is first
    assert first.encode("a b") == [1, 2]
    # a different vocabulary under the same name (the mtime is forced to differ)
    _save(tmp_path, {"<unk>": 0, "b": 1, "a": 2, "c": 3})
    st = os.stat(tmp_path / "tokenizer.json")
    os.utime(tmp_path / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = TextTokenizer.find([str(tmp_path)])
    assert second is not first and second.encode("a b") == [2, 1]
    # the end-of-sequence ids come from the configs: a new config.json is a new key too
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    third = TextTokenizer.find([str(tmp_path)])
    assert third is not second and third.eos_token_ids == {3}
    assert isinstance(third.eos_token_ids, frozenset)  # shared: callers cannot change it
