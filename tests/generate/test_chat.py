"""ChatSession on the mini decoder with a tiny word-level tokenizer and chat template.

The decoder (2 GQA layers, rotary, 64 positions, vocab 50, random weights) is
converted per test; the tokenizer maps ``<unk> <s> </s> <system> <user>
<assistant>`` to ids 0-5 and ``w6`` ... ``w49`` to 6-49, and every special id
ends an answer (so a decoded answer re-renders to the same ids). References:
``onnx_light_ep.generate.generate`` (the padded batch loop, one prefill of the
whole conversation) for the answers, the arena's ``bytes_appended`` for the
tokens a turn ran.
"""
import io
import json
import os
import re

import numpy as np
import pytest

from onnx_light_ep import KVCache
from onnx_light_ep.chat import ChatPositionLimitError, ChatSession
from onnx_light_ep.generate import generate

SPECIALS = ["<unk>", "<s>", "</s>", "<system>", "<user>", "<assistant>"]
EOS = range(len(SPECIALS))
PLAIN = ("{% for m in messages %}<{{ m.role }}> {{ m.content }} </s> {% endfor %}"
         "{% if add_generation_prompt %}<assistant> {% endif %}")
# Earlier assistant turns keep only their first word (as templates that drop earlier reasoning do).
FIRST_WORD = ("{% for m in messages %}<{{ m.role }}> {% if m.role == 'assistant' and not loop.last %}"
              "{{ m.content.split(' ')[0] }}{% else %}{{ m.content }}{% endif %} </s> {% endfor %}"
              "{% if add_generation_prompt %}<assistant> {% endif %}")
# A header that counts the messages: every turn renders differently from token 1 on.
COUNTED = ("<system> w{{ 6 + messages|length }} </s> {% for m in messages %}<{{ m.role }}> {{ m.content }} </s> "
           "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}")
BYTES_PER_TOKEN = 2 * 2 * (16 + 16) * 4   # layers x kv heads x (head_dim + v_head_dim) x fp32


def write_tokenizer(folder, template):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), 50)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(SPECIALS)
    tk.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(template)


@pytest.fixture
def chat_model(mini_decoder, tmp_path):
    """``make(template=PLAIN) -> converted path`` with the tokenizer next to it."""
    def make(template=PLAIN, name="m"):
        _, dst = mini_decoder(do_rotary=True, d=16, seed=3, name=name)
        write_tokenizer(str(tmp_path), template)
        return dst
    return make


def reference(dst, ids, n):
    """Greedy answer of the batch loop after one prefill of ``ids`` (stops at a special id)."""
    return generate(dst, prompt_ids=[ids], max_new_tokens=n, eos_token_ids=EOS).token_ids[0]


def consistent(chat):
    return chat.cache.seq_lens.tolist() == [len(chat.token_ids)]


def test_second_turn_appends_only_its_own_tokens(chat_model):
    dst = chat_model()
    notes = []
    with ChatSession(dst, max_new_tokens=6, eos_token_ids=EOS, log=notes.append) as chat:
        pieces = []
        t1 = chat.send("w10 w11 w12", stream=pieces.append)
        assert t1.cached_tokens == 0 and t1.dropped_tokens == 0
        assert t1.appended_tokens == len(chat.render([{"role": "user", "content": "w10 w11 w12"}]))
        assert "".join(pieces) == t1.text and t1.token_ids
        assert t1.context_tokens == t1.appended_tokens + len(t1.token_ids) and consistent(chat)
        before = chat.cache.stats()["bytes_appended"]
        context1 = chat.token_ids
        t2 = chat.send("w13 w14")
        full = chat.render(chat.messages[:-1])   # user, answer, user: the rendering turn 2 ran
        assert full[:len(context1)] == context1   # the cached ids were a prefix
        assert t2.cached_tokens == len(context1) and t2.dropped_tokens == 0 and not notes
        assert t2.appended_tokens == len(full) - len(context1)
        # the arena ran exactly the new turn's tokens plus the answer's
        assert chat.cache.stats()["bytes_appended"] - before == \
            (t2.appended_tokens + len(t2.token_ids)) * BYTES_PER_TOKEN
        assert t2.token_ids == reference(dst, full, 6)
        assert chat.token_ids == full + t2.token_ids and consistent(chat)
        assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2


@pytest.mark.parametrize("template,where", [(FIRST_WORD, "answer"), (COUNTED, "header")])
def test_template_that_re_renders_earlier_turns_falls_back_to_the_common_prefix(chat_model, template, where):
    dst = chat_model(template)
    notes = []
    with ChatSession(dst, max_new_tokens=6, eos_token_ids=EOS, log=notes.append) as chat:
        t1 = chat.send("w10 w11 w12")
        assert len(t1.token_ids) >= 2   # an answer of several words, so FIRST_WORD changes it
        context1 = chat.token_ids
        t2 = chat.send("w13 w14")
        full = chat.render(chat.messages[:-1])
        common = next(i for i, (a, b) in enumerate(zip(context1, full)) if a != b)
        if where == "header":
            assert common == 1
        else:
            assert common == t1.appended_tokens + 1   # the first answer word is kept
        assert t2.cached_tokens == common and t2.dropped_tokens == len(context1) - common
        assert t2.appended_tokens == len(full) - common
        assert len(notes) == 1 and f"at token {common} of {len(context1)}" in notes[0]
        assert t2.token_ids == reference(dst, full, 6)
        assert chat.token_ids == full + t2.token_ids and consistent(chat)


def test_send_ids_reuses_the_common_prefix_and_reruns_the_rest(chat_model):
    dst = chat_model()
    with ChatSession(dst, max_new_tokens=4, eos_token_ids=EOS) as chat:
        a = [4, 10, 11, 12, 2, 5]
        ta = chat.send_ids(a)
        assert chat.token_ids == a + ta.token_ids and chat.tokenizer is not None
        b = a[:3] + [20, 21, 2, 5]   # diverges at token 3
        tb = chat.send_ids(b)
        assert (tb.cached_tokens, tb.dropped_tokens, tb.appended_tokens) == (3, len(a) + len(ta.token_ids) - 3, 4)
        assert tb.token_ids == reference(dst, b, 4) and consistent(chat)
        same = chat.token_ids   # the conversation exactly as cached: its last token is re-run for the logits
        tc = chat.send_ids(same)
        assert (tc.cached_tokens, tc.appended_tokens) == (len(same) - 1, 1) and consistent(chat)
        with pytest.raises(ValueError, match=r"conversation_ids; expected token ids in \[0, 50\).*got 50"):
            chat.send_ids(same + [50])
        with pytest.raises(ValueError, match=r"conversation_ids; expected at least one token id"):
            chat.send_ids([])
        with pytest.raises(ValueError, match=r"max_new_tokens; expected >= 1, got 0"):
            chat.send_ids(same, max_new_tokens=0)
        assert consistent(chat)


def test_position_limit_refuses_then_reset_recovers(chat_model):
    dst = chat_model()
    with ChatSession(dst, max_new_tokens=60, eos_token_ids=[]) as chat:
        assert chat.max_positions == 64
        t = chat.send_ids([4, 10, 11, 2, 5])
        assert t.stop_reason == "max_position" and len(t.token_ids) == 64 - 5 and t.context_tokens == 64
        assert consistent(chat)
        held = chat.token_ids
        with pytest.raises(ChatPositionLimitError, match=r"needs 66 tokens before the answer and the model has 64 "
                                                         r"positions.*/reset") as e:
            chat.send_ids(held + [2, 5])
        assert (e.value.conversation_tokens, e.value.max_positions) == (66, 64)
        assert chat.token_ids == held and consistent(chat)   # nothing changed
        chat.reset()
        assert chat.token_ids == [] and chat.messages == [] and chat.cache.seq_lens.tolist() == [0]
        t = chat.send_ids([4, 10, 11, 2, 5], max_new_tokens=3)
        assert t.stop_reason == "max_new_tokens" and len(t.token_ids) == 3


def test_save_reset_load_continues_with_the_same_answer(chat_model, tmp_path):
    dst = chat_model()
    path = str(tmp_path / "conv.kv")
    with ChatSession(dst, system="w40 w41", max_new_tokens=5, eos_token_ids=EOS) as chat:
        chat.send("w10 w11 w12")
        chat.save(path)
        saved = json.load(open(path + ".json"))
        assert saved["token_ids"] == chat.token_ids and saved["system"] == "w40 w41"
        assert saved["messages"] == chat.messages[1:]
        want = chat.send("w13 w14")
        chat.reset()
        assert chat.messages == [{"role": "system", "content": "w40 w41"}]   # the system prompt stays
        chat.load(path)
        assert chat.token_ids == saved["token_ids"] and consistent(chat)
        got = chat.send("w13 w14")
        assert got.token_ids == want.token_ids and got.cached_tokens == len(saved["token_ids"])
    with ChatSession(dst, max_new_tokens=5, eos_token_ids=EOS) as other:   # a new session: system from the file
        other.load(path)
        assert other.system == "w40 w41"
        assert other.send("w13 w14").token_ids == want.token_ids


def _write_sidecar(path, ids, **over):
    data = dict(format="onnx_light_ep.chat", version=1, system=None, messages=[], token_ids=ids)
    data.update(over)
    with open(path + ".json", "w") as f:
        json.dump(data, f)


def test_bad_load_keeps_the_conversation(chat_model, tmp_path):
    dst = chat_model()
    with ChatSession(dst, max_new_tokens=3, eos_token_ids=EOS) as chat:
        chat.send("w10 w11")
        ids, messages = chat.token_ids, chat.messages
        other = str(tmp_path / "other.kv")   # a cache of another geometry (1 layer)
        with KVCache(1, 1, 2, 16, dtype="float32", max_sequence_length=64) as c:
            c.save(other)
        _write_sidecar(other, [])
        garbage = str(tmp_path / "garbage.kv")
        open(garbage, "wb").write(b"not a cache file at all")
        _write_sidecar(garbage, [])
        good = str(tmp_path / "good.kv")
        chat.save(good)
        cases = [(str(tmp_path / "missing.kv"), r"missing\.kv\.json'; expected the conversation /save writes"),
                 (other, r"holds a cache of another model: num_layers 1, expected 2"),
                 (garbage, r"not a KVCache file \(wrong magic")]
        for path, match in cases:
            with pytest.raises(ValueError, match=match):
                chat.load(path)
        for over, match in [(dict(format="x"), r'"format": "onnx_light_ep.chat"'),
                            (dict(version=2), r'"version": 1, got 2'),
                            (dict(token_ids=[1, "a"]), r'"token_ids": a list of ints'),
                            (dict(token_ids=[1, 99]), r'in \[0, 50\).*got 99'),
                            (dict(messages=[{"role": "user"}]), r'"messages": a list'),
                            (dict(token_ids=[1, 2]), r"holds \d+ tokens but .* lists 2 token ids")]:
            _write_sidecar(good, ids, **over)
            with pytest.raises(ValueError, match=match):
                chat.load(good)
        assert chat.token_ids == ids and chat.messages == messages and consistent(chat)
        t = chat.send("w13")   # the session goes on, on its own cache
        assert t.cached_tokens == len(ids) and t.dropped_tokens == 0


def test_interrupted_answer_keeps_exactly_the_shown_tokens(chat_model):
    dst = chat_model()
    with ChatSession(dst, max_new_tokens=8, eos_token_ids=EOS) as chat:
        shown = []

        def stream(piece):
            shown.append(piece)
            if len(shown) == 3:
                raise KeyboardInterrupt

        t = chat.send("w10 w11 w12", stream=stream)
        assert t.stop_reason == "interrupted" and len(t.token_ids) == 3 and "".join(shown) == t.text
        assert consistent(chat) and chat.messages[-1] == {"role": "assistant", "content": t.text}
        t2 = chat.send("w13")
        assert t2.dropped_tokens == 0 and consistent(chat)


def test_interrupt_after_a_committed_run_is_undone(chat_model):
    """Ctrl-C landing after a run committed but before it was recorded: the cache is truncated back."""
    dst = chat_model()
    with ChatSession(dst, max_new_tokens=8, eos_token_ids=EOS) as chat:
        real = chat._stepper.run
        calls = []

        def run(cache, ids, **kw):
            out = real(cache, ids, **kw)
            calls.append(1)
            if len(calls) == 3:   # the prompt (prefill runs through run), answer token 1, token 2 committed
                raise KeyboardInterrupt
            return out

        chat._stepper.run = run
        t = chat.send("w10 w11 w12")
        assert t.stop_reason == "interrupted" and len(t.token_ids) == 1 and consistent(chat)
        chat._stepper.run = real

        def prefill(cache, ids, **kw):   # the prompt's run committed, then Ctrl-C
            type(chat._stepper).prefill(chat._stepper, cache, ids, **kw)
            raise KeyboardInterrupt

        held, messages = chat.token_ids, chat.messages
        chat._stepper.prefill = prefill
        t = chat.send("w13 w14")
        assert t.stop_reason == "interrupted" and t.token_ids == [] and t.appended_tokens == 0
        assert chat.token_ids == held and chat.messages == messages and consistent(chat)
        del chat._stepper.prefill
        assert chat.send("w13 w14").dropped_tokens == 0


def test_failed_run_leaves_the_cache_matching_the_ids(chat_model):
    dst = chat_model()
    with ChatSession(dst, max_new_tokens=8, eos_token_ids=EOS) as chat:
        real = chat._stepper.run
        calls = []

        def run(cache, ids, **kw):
            calls.append(1)
            if len(calls) == 3:   # the prompt, answer token 1, then token 2 fails
                raise RuntimeError("run failed")
            return real(cache, ids, **kw)

        chat._stepper.run = run
        messages = chat.messages
        with pytest.raises(RuntimeError, match="run failed"):
            chat.send("w10 w11 w12")
        assert consistent(chat) and chat.messages == messages
        chat._stepper.run = real
        t = chat.send("w10 w11 w12")   # the same prompt: the answer token run before the failure is dropped, the last prompt token re-run
        assert (t.appended_tokens, t.dropped_tokens) == (1, 2) and consistent(chat)


def test_sampling_is_seeded_and_arguments_are_checked(chat_model):
    dst = chat_model()
    answers = []
    for _ in range(2):
        with ChatSession(dst, max_new_tokens=6, temperature=1.5, top_k=20, seed=7, eos_token_ids=EOS) as chat:
            answers.append([chat.send("w10 w11").token_ids, chat.send("w12").token_ids])
    assert answers[0] == answers[1]
    with pytest.raises(ValueError, match="temperature; expected a finite number >= 0"):
        ChatSession(dst, temperature=-1)
    with pytest.raises(ValueError, match="chat: max_new_tokens; expected >= 1, got 0"):
        ChatSession(dst, max_new_tokens=0)
    with pytest.raises(FileNotFoundError, match="chat: model; expected an ONNX file"):
        ChatSession(str(dst) + ".missing")
    with ChatSession(dst) as chat:
        with pytest.raises(ValueError, match="chat: text; expected a non-empty message"):
            chat.send("")


def test_text_turns_need_a_tokenizer(mini_decoder):
    _, dst = mini_decoder(do_rotary=True, d=16)
    with ChatSession(dst, max_new_tokens=2) as chat:
        assert chat.tokenizer is None
        with pytest.raises(ValueError, match="chat: text turns; expected tokenizer.json"):
            chat.send("hello")
        t = chat.send_ids([1, 2, 3])
        assert t.text is None and consistent(chat)


def test_repl_commands_and_limits(chat_model, tmp_path):
    """run_chat with scripted lines: commands, errors, both ends of the position limit, /quit."""
    from onnx_light_ep._chat_cli import run_chat

    dst = chat_model()
    path = str(tmp_path / "r.kv")

    def filling(target):   # a user line whose rendering after the conversation is ``target`` tokens long
        def line(chat):
            base = len(chat.render(chat.messages + [{"role": "user", "content": ""}]))
            return " ".join(["w13"] * (target - base))
        return line

    script = iter(["/stats", "/help", "/nope", "/save", "w10 w11", "/stats", "//w12", f"/save {path}",
                   f"/load {tmp_path / 'missing.kv'}", "", filling(64), filling(62), "w14", "/reset", "w15",
                   "/quit", "w16"])
    out = io.StringIO()
    with ChatSession(dst, max_new_tokens=8, eos_token_ids=[]) as chat:   # no end of sequence: 8 tokens or the limit
        def read(prompt):
            line = next(script)
            line = line(chat) if callable(line) else line
            out.write(prompt + line + "\n")
            return line

        assert run_chat(chat, stats=True, read=read, out=out) == 0
        text = out.getvalue()
        assert next(script) == "w16"   # /quit ended the loop
        assert "[stats] no turn yet; context 0/64" in text
        assert "/load FILE" in text and "error: unknown command /nope; /help lists the commands" in text
        assert "error: /save FILE; expected a file name" in text
        stats = re.findall(r"\[stats\] prompt \+\d+ tokens \([^)]*\), answer \d+ tokens, stop \w+", text)
        assert len(stats) == 5 and stats[0] == stats[1]   # the turn's line, then /stats repeats it
        saved = json.load(open(path + ".json"))["messages"]
        assert [m for m in saved if m["role"] == "user"] == [{"role": "user", "content": c} for c in ("w10 w11", "/w12")]
        assert "missing.kv.json'; expected the conversation /save writes" in text
        refusals = re.findall(r"error: chat: the conversation needs (\d+) tokens before the answer and the model has "
                              r"64 positions \(onnx_light.max_position\); start over with reset \(/reset\)", text)
        assert refusals[0] == "64" and len(refusals) == 2   # filling(64), then "w14" after the limit was reached
        assert "stop max_position" in stats[3] and "answer 2 tokens" in stats[3]
        assert "[the conversation reached the model's 64 positions: /reset starts over]" in text
        assert "[conversation reset]" in text and chat.messages[0] == {"role": "user", "content": "w15"}
        assert "Traceback" not in text


def test_cli_chat_reads_stdin_and_says_when_it_re_renders(chat_model, monkeypatch, capsys):
    from onnx_light_ep.cli import main

    dst = chat_model(COUNTED)
    monkeypatch.setattr("sys.stdin", io.StringIO("w10 w11\nw12\n"))
    assert main(["chat", dst, "-v", "--stats", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[debug\] chat: the rendering differs from the cached tokens at token 1 of \d+", out)
    assert re.search(r"\(cached 1, dropped \d+\)", out)


def test_cli_chat_usage_errors_exit_2(mini_decoder, chat_model, capsys, tmp_path):
    from onnx_light_ep.cli import main

    assert main(["chat", str(tmp_path / "missing.onnx")]) == 2
    assert "error: chat: model; expected an ONNX file" in capsys.readouterr().err
    _, bare = mini_decoder(do_rotary=True, d=16, name="bare")   # written before the tokenizer: none next to it
    bare_dir = tmp_path / "bare"
    bare_dir.mkdir()
    os.replace(bare, bare_dir / "bare.onnx")
    assert main(["chat", str(bare_dir / "bare.onnx")]) == 2
    err = capsys.readouterr().err
    assert "error: chat: text turns; expected tokenizer.json" in err and "Traceback" not in err
    dst = chat_model()
    assert main(["chat", dst, "--max-new-tokens", "0"]) == 2
    assert "error: chat: max_new_tokens; expected >= 1, got 0" in capsys.readouterr().err
