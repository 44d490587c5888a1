"""ChatSession given what a careless or hostile user gives it: ids that are not ints, counts that are bools or
floats, a /load of a cache file paired with an edited or foreign conversation file. Each is a ValueError naming
the argument (or the file), and the conversation and its cache stay as they were."""
import io
import json
import shutil

import pytest

from onnx_light_ep.chat import ChatSession
from onnx_light_ep.cli import main as cli_main
from test_chat import EOS, PLAIN, write_tokenizer

KW = dict(do_rotary=True, d=16)


def _consistent(chat):
    return chat.cache.seq_lens.tolist() == [len(chat.token_ids)]


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=True), r"chat: max_new_tokens; expected an int >= 1, got True"),
    (dict(max_new_tokens=2.5), r"chat: max_new_tokens; expected an int >= 1, got 2.5"),
    (dict(temperature=True), r"chat: temperature; expected a finite number >= 0"),
    (dict(top_k=1.5, temperature=1.0), r"chat: top_k; expected an int >= 0"),
    (dict(seed="x"), r"chat: seed; expected an int >= 0 or None, got 'x'"),
    (dict(threads=-2), r"chat: threads; expected an int >= 0 or None"),
    (dict(eos_token_ids="2"), r"chat: eos_token_ids; expected an int or a sequence of ints, got '2'"),
    (dict(max_sequence_length=0), r"chat: max_sequence_length; expected an int >= 1 \(cache capacity in tokens\) "
                                  r"or None \(the model's onnx_light.max_position\), got 0"),
    (dict(max_sequence_length=True), r"chat: max_sequence_length; expected an int >= 1 .*got True"),
    (dict(max_sequence_length=64.0), r"chat: max_sequence_length; expected an int >= 1 .*got 64.0"),
])
def test_bad_session_arguments_are_refused(mini_decoder, kw, match):
    _, dst = mini_decoder(**KW)
    with pytest.raises(ValueError, match=match):
        ChatSession(dst, **kw)


@pytest.mark.parametrize("ids,kw,match", [
    ([3.5, 4], {}, r"chat: conversation_ids; expected integer token ids, got 3.5"),
    ("345", {}, r"chat: conversation_ids; expected a sequence of integer token ids, got a str"),
    ([True, 4], {}, r"chat: conversation_ids; expected integer token ids, got True"),
    ([3, 4], dict(max_new_tokens=True), r"chat: max_new_tokens; expected an int >= 1 or None, got True"),
    ([3, 4], dict(max_new_tokens=1.5), r"chat: max_new_tokens; expected an int >= 1 or None, got 1.5"),
    ([3, 4], dict(max_new_tokens="2"), r"chat: max_new_tokens; expected an int >= 1 or None, got '2'"),
    ([3, 4], dict(stream=1), r"chat: stream; expected a callable taking each new piece of text, or None"),
])
def test_bad_turn_arguments_change_nothing(mini_decoder, ids, kw, match):
    """3.5 ran as 3, "345" as the ids [3, 4, 5], True as 1, max_new_tokens=1.5 as 1: now refused before the
    cache is touched."""
    _, dst = mini_decoder(**KW)
    with ChatSession(dst, max_new_tokens=3, eos_token_ids=[0]) as chat:
        chat.send_ids([3, 4, 5])
        before = chat.token_ids
        with pytest.raises(ValueError, match=match):
            chat.send_ids(ids, **kw)
        assert chat.token_ids == before and _consistent(chat)


def _saved(tmp_path, mini_decoder):
    _, dst = mini_decoder(**KW, seed=3)
    write_tokenizer(str(tmp_path), PLAIN)
    chat = ChatSession(dst, max_new_tokens=4, eos_token_ids=EOS)
    chat.send("w10 w11 w12")
    path = str(tmp_path / "conv.kv")
    chat.save(path)
    return chat, path


def test_a_conversation_file_edited_to_other_ids_of_the_same_length_is_refused(mini_decoder, tmp_path):
    """The cache file holds the K/V of the saved ids; a sidecar whose token_ids were edited (same count) was
    loaded, and the next turn attended K/V of other tokens than the ones it believed were there."""
    chat, path = _saved(tmp_path, mini_decoder)
    with chat:
        ids, messages = chat.token_ids, chat.messages
        data = json.load(open(path + ".json"))
        data["token_ids"] = [9] * len(data["token_ids"])
        json.dump(data, open(path + ".json", "w"))
        with pytest.raises(ValueError, match=r"chat.load: .*conv\.kv\.json' does not describe .*conv\.kv' \(sha256 "
                                             r"of the cache file and the token ids differs from its \"digest\"\); "
                                             r"expected the pair /save wrote; the current conversation is kept"):
            chat.load(path)
        assert chat.token_ids == ids and chat.messages == messages and _consistent(chat)


def test_a_sidecar_of_another_save_of_the_same_length_is_refused(mini_decoder, tmp_path):
    """A conversation file beside the cache of another conversation holding as many tokens, or one without its
    digest, is refused; the genuine pair loads."""
    chat, path = _saved(tmp_path, mini_decoder)
    n = len(chat.token_ids)
    with chat, ChatSession(str(tmp_path / "m.light.onnx"), max_new_tokens=1, eos_token_ids=[]) as other_chat:
        other_chat.send_ids([6] * (n - 1))
        assert len(other_chat.token_ids) == n and other_chat.token_ids != chat.token_ids
        other = str(tmp_path / "other.kv")
        other_chat.save(other)
        shutil.copy(path + ".json", other + ".json")   # conv's conversation beside other's cache
        with pytest.raises(ValueError, match=r"differs from its \"digest\""):
            chat.load(other)
        data = json.load(open(path + ".json"))
        del data["digest"]
        json.dump(data, open(other + ".json", "w"))
        with pytest.raises(ValueError, match=r"\"digest\": the sha256 /save writes"):
            chat.load(other)
        ids = chat.token_ids
        chat.reset()
        chat.load(path)   # the genuine pair loads
        assert chat.token_ids == ids and _consistent(chat)


def test_cli_load_of_a_tampered_file_prints_an_error_and_goes_on(mini_decoder, tmp_path, monkeypatch, capsys):
    chat, path = _saved(tmp_path, mini_decoder)
    chat.close()
    data = json.load(open(path + ".json"))
    data["token_ids"][-1] = (data["token_ids"][-1] + 1) % 50
    json.dump(data, open(path + ".json", "w"))
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/load {path}\nw10\n"))
    assert cli_main(["chat", str(tmp_path / "m.light.onnx"), "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "error: chat.load:" in out and "digest" in out and "Traceback" not in out
