"""TextTokenizer.prefix_ids: the special ids a tokenizer's own post-processor puts before a text
(Gemma-3 puts <bos>, SmolLM2 nothing), read from tokenizer.json."""
import pytest

from onnx_light_ep._text import TextTokenizer


def _folder(tmp_path, with_bos):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({"<bos>": 0, "<unk>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    d = tmp_path / ("bos" if with_bos else "plain")
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return str(d)


@pytest.mark.parametrize("with_bos,want", [(True, [0]), (False, [])])
def test_prefix_ids(tmp_path, with_bos, want):
    t = TextTokenizer.find([_folder(tmp_path, with_bos)])
    assert t.prefix_ids() == want
    assert t.encode("a b") == [2, 3]  # encode itself still adds nothing
