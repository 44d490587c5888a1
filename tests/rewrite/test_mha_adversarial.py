"""com.microsoft.MultiHeadAttention / Attention with attribute values CacheAttention cannot express: convert
leaves that attention as it is and names the attribute (it wrote models whose session ORT refused:
'attribute scale must be finite and >= 0', 'is_causal must be 0 or 1')."""
import functools

import pytest

import rw_graphs as G
import rw_harness as H
import rw_mha_graphs as M
from onnx_light_ep.rewrite import ConvertError

MS_OPSETS = (("", 17), ("com.microsoft", 1))
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


def mha(**kw):
    return functools.partial(G.decoder, M.mha_block, hq=4, hkv=4, d=8, opsets=MS_OPSETS, mask="kpm2d", **kw)


def attention(**kw):
    return functools.partial(M.ms_attention_decoder, mask="2d", **kw)


@pytest.mark.parametrize("make,words", [
    (mha(unidirectional=1, scale=-0.3), "scale -0.3: CacheAttention takes a finite scale >= 0"),
    (attention(scale=-0.5), "scale -0.5: CacheAttention takes a finite scale >= 0"),
    (mha(unidirectional=1, scale=float("inf")), "scale inf: CacheAttention takes a finite scale >= 0"),
    (attention(unidirectional=2), "unidirectional=2: expected 0 or 1"),
    (mha(unidirectional=-1), "unidirectional=-1: expected 0 or 1"),
    (attention(mask_filter_value=float("nan")), "mask_filter_value nan: expected a number"),
    (mha(unidirectional=1, mask_filter_value=float("nan")), "mask_filter_value nan: expected a number"),
])
def test_attribute_values_cache_attention_cannot_take_are_refused(make, words, tmp_path):
    with pytest.raises(ConvertError, match="no attention with a loop-carried KV cache") as e:
        H.convert_model(make(layers=2), tmp_path, "m")
    assert words in str(e.value)


@pytest.mark.parametrize("make", [mha(unidirectional=1, scale=0.0), attention(scale=0.0),
                                  attention(mask_filter_value=float("-inf"))])
def test_scale_zero_and_an_infinite_filter_still_match_plain_ort(make, tmp_path):
    """scale=0 is 1/sqrt(head_size) in ORT's kernels and in CacheAttention; mask_filter_value=-inf drops the
    padded keys: both convert and match plain ORT (fp32, 1e-4) on a left-padded batch of 2."""
    report, src, dst = H.convert_model(make(layers=2), tmp_path, "m")
    assert not report.refused
    H.greedy_steps(src, dst, report, [PROMPT, PROMPT[4:]], 8, padding="left", atol=1e-4)
