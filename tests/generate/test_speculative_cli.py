"""onnx-light generate --speculative prompt-lookup|draft --num-draft-tokens K --max-ngram-size N --draft-model PATH."""
import re

import pytest

from onnx_light_ep.cli import main

IDS = "5,9,2,14,7,3,30,11"


def _ids(out):
    return re.search(r"\[0\] ids: (\[.*\])", out).group(1)


def test_speculative_flags_give_the_greedy_ids(mini_decoder, capsys):
    _, dst = mini_decoder()
    _, drf = mini_decoder(name="draft", seed=7)
    assert main(["generate", dst, "--prompt-ids", IDS, "--max-new-tokens", "40", "-q"]) == 0
    want = _ids(capsys.readouterr().out)
    for extra in (["--speculative", "prompt-lookup", "--num-draft-tokens", "3", "--max-ngram-size", "2"],
                  ["--speculative", "draft", "--draft-model", drf]):
        assert main(["generate", dst, "--prompt-ids", IDS, "--max-new-tokens", "40", "-q", *extra]) == 0
        cap = capsys.readouterr()
        assert _ids(cap.out) == want
        assert re.search(rf"speculative {extra[1]}: \d+ of \d+ draft tokens accepted \(\d+%\) in \d+ verification "
                         r"runs", cap.err), cap.err


@pytest.mark.parametrize("extra,flag", [
    (["--speculative", "prompt-lookup", "--num-draft-tokens", "0"], "--num-draft-tokens; expected an int >= 1"),
    (["--speculative", "prompt-lookup", "--max-ngram-size", "0"], "--max-ngram-size; expected an int >= 1"),
    (["--speculative", "draft"], "--draft-model; expected the converted draft model's path"),
    (["--speculative", "prompt-lookup", "--draft-model", "x.onnx"], "--draft-model; only used with --speculative draft"),
    (["--draft-model", "x.onnx"], "--draft-model; only used with --speculative"),
    (["--num-draft-tokens", "4"], "--num-draft-tokens; only used with --speculative"),
    (["--speculative", "prompt-lookup", "--temperature", "0.8"], "--temperature; --speculative is greedy only"),
    (["--speculative", "draft", "--draft-model", "missing.onnx"], "--draft-model; expected a converted ONNX file"),
])
def test_bad_speculative_flags_exit_2_naming_the_flag(mini_decoder, capsys, extra, flag):
    _, dst = mini_decoder()
    assert main(["generate", dst, "--prompt-ids", IDS, "-q", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("extra,flag", [(["--speculative", "ngram"], "argument --speculative: invalid choice"),
                                        (["--speculative", "draft", "--num-draft-tokens", "x"],
                                         "argument --num-draft-tokens: invalid int value")])
def test_unparsable_speculative_flags_exit_2(mini_decoder, capsys, extra, flag):
    _, dst = mini_decoder()
    with pytest.raises(SystemExit) as e:
        main(["generate", dst, "--prompt-ids", IDS, *extra])
    assert e.value.code == 2 and flag in capsys.readouterr().err
