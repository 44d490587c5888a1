"""``python -m onnx_light_ep chat MODEL`` typed into a pseudo-terminal, on the real SmolLM2-135M-Instruct.

One session, as a user would drive it: a fact, then a question about it (the
second turn runs only its own tokens: checked against the tokenizer's own
rendering of the saved conversation), /save, bad /load files (clear errors,
the conversation kept), /reset + /load + the same question (the same answer
as without the round trip), Ctrl-C during an answer (the cache keeps exactly
the shown text: the next turn reuses all of it), Ctrl-C at the prompt, Ctrl-D.
The conversations are read back from the JSON files /save writes.
"""
import io
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from chat_pty import Terminal
from onnx_light_ep import KVCache
from onnx_light_ep._text import TextTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATS = (r"\[stats\] prompt \+(?P<appended>\d+) tokens \(cached (?P<cached>\d+)(?:, dropped (?P<dropped>\d+))?\), "
         r"answer (?P<answer>\d+) tokens, stop (?P<stop>\w+);[^\n]*; context (?P<context>\d+)/(?P<limit>\d+)\n> ")


@pytest.fixture(scope="module")
def smollm2():
    from onnx_light_ep.demo import ensure_converted
    from onnx_light_ep.models.smollm2 import ensure_smollm2_onnx

    return str(ensure_converted(Path(ensure_smollm2_onnx(progress=False)), out=io.StringIO()))


def _stats(term):
    m = term.expect(STATS)
    return {k: (v if k == "stop" else int(v or 0)) for k, v in m.groupdict().items()}


def _saved(path):
    with open(path + ".json", encoding="utf-8") as f:
        return json.load(f)


def test_chat_in_a_terminal(smollm2, tmp_path):
    tok = TextTokenizer.find([os.path.dirname(smollm2)])
    env = dict(os.environ, TERM="dumb", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    term = Terminal([sys.executable, "-m", "onnx_light_ep", "chat", smollm2, "--stats", "-v",
                     "--max-new-tokens", "20"], cwd=str(tmp_path), env=env)
    f1, f2, f2b, f3, f4 = (str(tmp_path / f"{n}.kv") for n in ("f1", "f2", "f2b", "f3", "f4"))
    try:
        term.expect(r"chat: 8192 positions; /help lists the commands, /quit or Ctrl-D ends\n> ")
        term.sendline("I have a dog called Rex.")
        s1 = _stats(term)
        assert (s1["cached"], s1["dropped"], s1["limit"]) == (0, 0, 8192)
        assert s1["context"] == s1["appended"] + s1["answer"]
        term.sendline(f"/save {f1}")
        term.expect(rf"\[saved {s1['context']} tokens to {re.escape(f1)} \(\+ {re.escape(f1)}\.json\)\]\n> ")

        question = {"role": "user", "content": "What is my dog called?"}
        term.sendline(question["content"])
        s2 = _stats(term)
        one = _saved(f1)
        rendering = tok.encode(tok.render_chat(one["messages"] + [question]))
        assert rendering[:s1["context"]] == one["token_ids"]   # the cache was a prefix of the new rendering
        assert (s2["cached"], s2["dropped"]) == (s1["context"], 0)
        assert s2["appended"] == len(rendering) - s1["context"]   # only the new turn's tokens ran
        assert "[debug]" not in term.text
        term.sendline(f"/save {f2}")
        term.expect(r"\[saved[^\n]*\n> ")
        two = _saved(f2)
        assert two["token_ids"][:len(rendering)] == rendering and len(two["token_ids"]) == s2["context"]
        assert "Rex" in two["messages"][-1]["content"], two["messages"]

        other = str(tmp_path / "other.kv")   # another geometry, with a well-formed conversation file
        with KVCache(2, 1, 3, 64, dtype="float32", max_sequence_length=64) as c:
            c.save(other)
        with open(other + ".json", "w") as f:
            json.dump(dict(format="onnx_light_ep.chat", version=1, system=None, messages=[], token_ids=[]), f)
        term.sendline(f"/load {other}")
        term.expect(r"error: chat\.load: [^\n]* holds a cache of another model: num_layers 2, expected 30 "
                    r"\(this model's\); the current conversation is kept\n> ")
        term.sendline(f"/load {tmp_path / 'missing.kv'}")
        term.expect(r"error: chat\.load: [^\n]*missing\.kv\.json'; expected the conversation /save writes[^\n]*\n> ")
        term.sendline(f"/save {f2b}")
        term.expect(r"\[saved[^\n]*\n> ")
        assert _saved(f2b)["token_ids"] == two["token_ids"] and _saved(f2b)["messages"] == two["messages"]

        term.sendline("/reset")
        term.expect(r"\[conversation reset\]\n> ")
        term.sendline(f"/load {f1}")
        term.expect(rf"\[loaded {s1['context']} tokens, 2 messages from {re.escape(f1)}\]\n> ")
        term.sendline(question["content"])
        s3 = _stats(term)
        assert s3 == s2   # the same tokens appended, cached and generated
        term.sendline(f"/save {f3}")
        term.expect(r"\[saved[^\n]*\n> ")
        assert _saved(f3)["token_ids"] == two["token_ids"]   # the same answer as without the round trip

        term.sendline("Write a long story about a dragon.")
        term.expect(r"a dragon\.\n")
        start = term.pos
        term.expect(r"\w+ \w+ \w+")   # a few words of the answer are on the screen
        term.send("\x03")
        end = term.expect(r"\n\[interrupted\]\n").start()
        shown_text = term.text[start:end].replace("^C", "")   # the tty echoes ^C where the key landed
        s4 = _stats(term)
        assert s4["stop"] == "interrupted" and 0 < s4["answer"] < 32
        term.sendline(f"/save {f4}")
        term.expect(r"\[saved[^\n]*\n> ")
        four = _saved(f4)
        assert four["messages"][-1]["content"] == shown_text   # the conversation keeps what was shown
        assert len(four["token_ids"]) == s4["context"]
        term.sendline("Thank you.")
        s5 = _stats(term)
        assert (s5["cached"], s5["dropped"]) == (s4["context"], 0)   # the cache held exactly the shown tokens
        assert "[debug]" not in term.text

        # The prompt is on the screen (STATS ends with it); a user takes a moment before pressing Ctrl-C.
        # (A SIGINT in the microseconds between the prompt's write and readline's blocking select() is
        # only seen at the next key, in CPython itself; the pause keeps the test off that race.)
        time.sleep(0.5)
        term.send("\x03")   # at the prompt: a fresh line, the session goes on
        term.expect(r"\n> ")
        term.sendline("/help")
        term.expect(r"/load FILE[^\n]*\n(?:[^\n]*\n)*> ")
        term.send("\x04")   # Ctrl-D
        assert term.wait() == 0
        assert "Traceback" not in term.text
    finally:
        term.close()
