"""The interactive loop of ``onnx-light chat MODEL`` over a :class:`onnx_light_ep.chat.ChatSession`.

Reads a line, streams the answer, repeats. Lines starting with ``/`` are
commands (``HELP``); ``//text`` sends ``/text``. EOF (Ctrl-D) and ``/quit``
end the loop; Ctrl-C while an answer is generated stops that answer (the
session keeps what was shown), at the prompt it clears the line. Errors of a
turn or a command print ``error: ...`` and the loop goes on.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, TextIO

from .chat import ChatSession, ChatTurn

__all__ = ["HELP", "format_stats", "run_chat"]

HELP = """commands:
  /reset       forget the conversation (the system prompt stays) and empty the cache
  /save FILE   write the cache to FILE and the conversation to FILE.json
  /load FILE   restore a conversation /save wrote (the current one is kept if FILE does not fit this model)
  /stats       the last turn's figures (--stats prints them after every turn)
  /help        this text
  /quit        end (also Ctrl-D); Ctrl-C stops an answer being generated
  //text       send a message that starts with '/'"""


def format_stats(turn: ChatTurn, max_positions: int) -> str:
    """One line: prompt tokens appended, cached (and dropped) tokens, answer tokens, stop reason, rates, context."""
    cached = f"cached {turn.cached_tokens}" + (f", dropped {turn.dropped_tokens}" if turn.dropped_tokens else "")
    pre = turn.prefill_tokens_per_second
    dec = turn.decode_tokens_per_second
    rates = f"prefill {pre:.0f} tokens/s" if turn.prefill_seconds > 0 else "no prefill"
    rates += f", decode {dec:.1f} tokens/s" if turn.decode_seconds > 0 else ""
    return (f"[stats] prompt +{turn.appended_tokens} tokens ({cached}), answer {len(turn.token_ids)} tokens, "
            f"stop {turn.stop_reason}; {rates}; context {turn.context_tokens}/{max_positions}")


def run_chat(chat: ChatSession, *, stats: bool = False, read: Callable[[str], str] = input,
             out: Optional[TextIO] = None, prompt: str = "> ") -> int:
    """Run the loop until ``/quit`` or EOF; returns the exit status (0).

    ``read(prompt)`` returns one line (``input`` by default; raises
    ``EOFError`` at the end); ``out`` defaults to ``sys.stdout``.
    """
    repl = _Repl(chat, stats, out or sys.stdout)
    repl.say(f"chat: {chat.max_positions} positions; /help lists the commands, /quit or Ctrl-D ends")
    while True:
        try:
            line = read(prompt)
        except EOFError:
            repl.say()
            return 0
        except KeyboardInterrupt:
            repl.say()
            continue
        try:
            if repl.handle(line.strip()) == "quit":
                return 0
        except KeyboardInterrupt:   # outside an answer (a command, a print): the session is consistent
            repl.say()
            repl.say("[interrupted]")


class _Repl:
    def __init__(self, chat: ChatSession, stats: bool, out: TextIO):
        self.chat, self.stats, self.out = chat, stats, out
        self.last: Optional[ChatTurn] = None

    def say(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=self.out, flush=True)

    def handle(self, text: str) -> Optional[str]:
        """One input line; returns "quit" to end the loop."""
        if not text:
            return None
        if text.startswith("/") and not text.startswith("//"):
            name, _, arg = text.partition(" ")
            if name in ("/quit", "/exit"):
                return "quit"
            try:
                self.command(name, arg.strip())
            except (ValueError, OSError, RuntimeError) as e:
                self.say(f"error: {e}")
            return None
        self.turn(text[1:] if text.startswith("//") else text)
        return None

    def command(self, name: str, arg: str) -> None:
        chat = self.chat
        if name == "/help":
            self.say(HELP)
        elif name == "/reset":
            chat.reset()
            self.say("[conversation reset]")
        elif name in ("/save", "/load") and not arg:
            self.say(f"error: {name} FILE; expected a file name")
        elif name == "/save":
            chat.save(arg)
            self.say(f"[saved {len(chat.token_ids)} tokens to {arg} (+ {arg}.json)]")
        elif name == "/load":
            chat.load(arg)
            self.say(f"[loaded {len(chat.token_ids)} tokens, {len(chat.messages)} messages from {arg}]")
        elif name == "/stats":
            self.say(format_stats(self.last, chat.max_positions) if self.last is not None else
                     f"[stats] no turn yet; context {len(chat.token_ids)}/{chat.max_positions}")
        else:
            self.say(f"error: unknown command {name}; /help lists the commands")

    def turn(self, text: str) -> None:
        chat = self.chat
        try:
            turn = chat.send(text, stream=lambda piece: self.say(piece, end=""))
        except ValueError as e:   # ChatPositionLimitError included: nothing changed
            self.say(f"error: {e}")
            return
        except (RuntimeError, MemoryError) as e:   # a failed run: undone, the turn is not kept
            self.say()
            self.say(f"error: {e} (this turn is dropped; the conversation goes on)")
            return
        self.last = turn
        self.say()
        if turn.stop_reason == "interrupted":
            self.say("[interrupted]")
        elif turn.stop_reason == "max_position":
            self.say(f"[the conversation reached the model's {chat.max_positions} positions: /reset starts over]")
        if self.stats:
            self.say(format_stats(turn, chat.max_positions))
