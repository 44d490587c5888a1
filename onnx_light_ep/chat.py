"""Multi-turn chat on one persistent ``KVCache``: each turn appends only its own tokens.

A :class:`ChatSession` keeps one cache (batch 1) for the whole conversation
and the token ids that cache holds. A turn renders the whole conversation
with the tokenizer's chat template (``TextTokenizer.render_chat``), encodes
it, and compares it with the cached ids: when the cached ids are a prefix of
the new rendering (the previous prompt, the answer tokens the model
generated, then the template's end-of-turn tokens and the new user turn),
only the tokens after them are run. When the template renders earlier turns
differently (a re-tokenized answer, a header that changes per turn) the cache
is truncated to the longest common prefix and the rest is run again; the
turn's ``dropped_tokens`` and the ``log`` callback say so. The runs go through
``onnx_light_ep.generate.CacheStepper``; the next token is chosen by
``sample_next`` (greedy by default).

Invariant: the cache holds exactly ``token_ids`` (the conversation so far),
after every turn, every failure and every ``KeyboardInterrupt``: each answer
token is run into the cache before it is shown, the end-of-sequence token is
not run (the next rendering supplies the template's end-of-turn tokens), and
an interrupted or failed run is undone (``onnx_light_ep.InferenceSession``
runs are transactions; a run that committed but was not yet recorded is
truncated away).

:meth:`ChatSession.save` writes the cache (``KVCache.save``) and, next to it in
``FILE.json``, the conversation (system prompt, messages, token ids);
:meth:`ChatSession.load` restores both after checking the file's geometry
against the model and its ``digest`` against both files. ``onnx-light chat MODEL`` (``onnx_light_ep._chat_cli``) is
the interactive front end.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

__all__ = ["ChatPositionLimitError", "ChatSession", "ChatTurn", "STOP_REASONS"]

SIDECAR_FORMAT = "onnx_light_ep.chat"
SIDECAR_VERSION = 1
# Why an answer ended: an end-of-sequence id, max_new_tokens, the model's last position, Ctrl-C.
STOP_REASONS = ("eos", "max_new_tokens", "max_position", "interrupted")
# The cache properties a loaded file must share with the model's own cache (KVCache.for_model).
_GEOMETRY = ("num_layers", "batch_size", "kv_num_heads", "head_dim", "v_head_dim", "dtype", "sliding_window")


class ChatPositionLimitError(ValueError):
    """The conversation does not fit the model's positions (``onnx_light.max_position``); nothing changed.

    ``conversation_tokens``: tokens the turn needs before its answer;
    ``max_positions``: the limit. ``ChatSession.reset`` starts over.
    """

    def __init__(self, message: str, conversation_tokens: int, max_positions: int):
        super().__init__(message)
        self.conversation_tokens = conversation_tokens
        self.max_positions = max_positions


@dataclass
class ChatTurn:
    """One answer (times in seconds).

    ``appended_tokens``: conversation tokens this turn ran before the answer
    (only the new turn's tokens when the cache was a prefix);
    ``cached_tokens``: tokens reused from the cache; ``dropped_tokens``: cached
    tokens discarded because the rendering differed from them;
    ``token_ids``/``text``: the answer (``text`` None without a tokenizer);
    ``stop_reason``: one of ``STOP_REASONS``; ``context_tokens``: tokens in
    the cache after the turn.
    """

    token_ids: List[int]
    text: Optional[str]
    stop_reason: str
    appended_tokens: int
    cached_tokens: int
    dropped_tokens: int
    context_tokens: int
    prefill_seconds: float
    decode_seconds: float

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.appended_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.token_ids) / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _digest(path: str, ids: Sequence[int]) -> str:
    """Hex sha256 of the file ``path`` followed by ``ids`` as int64 little-endian (the sidecar's ``digest``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(np.asarray(list(ids), dtype="<i8").tobytes())
    return h.hexdigest()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """A conversation with a converted decoder on the EP, on one ``KVCache`` that lives across turns.

    Args:
        model: path of a model written by ``onnx_light_ep.convert`` (an
            unconverted export is converted into a temporary file first).
        system: optional system prompt (the first message of every rendering;
            kept by :meth:`reset`).
        max_new_tokens: int >= 1, upper bound on answer tokens per turn.
        temperature, top_k, top_p, seed: sampling (``onnx_light_ep.generate.sample_next``;
            ``temperature=0``, the default, is greedy); one seeded
            ``numpy.random.Generator`` serves every turn.
        eos_token_ids: override the end-of-sequence ids found next to the model.
        tokenizer_dir: folder with ``tokenizer.json`` (default: the model's).
        session: an existing ``onnx_light_ep.InferenceSession`` of ``model``.
        threads, provider_options: for the session this class opens.
        cache_options: keyword arguments of the ``KVCache`` (``KVCache.for_model``):
            any of ``onnx_light_ep.generate.CACHE_OPTIONS``.
        max_sequence_length: cache capacity in tokens; None = the model's
            ``onnx_light.max_position`` (a model that records none needs it).
        log: called with a one-line note when a turn cannot reuse the whole
            cache (the template re-rendered earlier turns differently).

    Text turns (:meth:`send`) need the tokenizer and its chat template; token
    turns (:meth:`send_ids`) need neither.

    Raises:
        ValueError: bad arguments, a model these runs cannot feed (see
            ``CacheStepper``), no ``max_sequence_length`` for a model without
            ``max_position``.
        FileNotFoundError: ``model`` is not a file.

    Not thread-safe: one conversation, one caller.
    """

    def __init__(self, model, *, system: Optional[str] = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 eos_token_ids: Optional[Sequence[int]] = None, tokenizer_dir=None, session=None,
                 threads: Optional[int] = None, provider_options=None, cache_options: Optional[dict] = None,
                 max_sequence_length: Optional[int] = None, log: Optional[Callable[[str], None]] = None):
        from . import KVCache
        from .generate import CacheStepper
        from .generate._prepare import check_cache_options, check_sampling, prepare

        if system is not None and not isinstance(system, str):
            raise ValueError(f"chat: system; expected text or None, got {type(system).__name__}")
        check_cache_options(cache_options)
        check_sampling(temperature, top_k, top_p, seed, where="chat")
        if max_sequence_length is not None and (isinstance(max_sequence_length, bool) or not isinstance(
                max_sequence_length, (int, np.integer)) or max_sequence_length < 1):
            raise ValueError(f"chat: max_sequence_length; expected an int >= 1 (cache capacity in tokens) or None "
                             f"(the model's onnx_light.max_position), got {max_sequence_length!r}")
        try:
            self._prep = prepare(model, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                                 tokenizer_dir=tokenizer_dir, session=session, threads=threads,
                                 provider_options=provider_options, prompt_required=False)
        except (ValueError, FileNotFoundError) as e:   # prepare speaks for generate: name this caller
            if type(e) in (ValueError, FileNotFoundError) and str(e).startswith("generate: "):
                raise type(e)("chat: " + str(e)[len("generate: "):]) from None
            raise
        try:
            if max_sequence_length is None and not self._prep.max_position:
                raise ValueError("chat: max_sequence_length; the model records no onnx_light.max_position (no "
                                 "rotary table to read it from): expected the cache capacity in tokens "
                                 "(max_sequence_length=N; CLI --max-sequence-length N)")
            self._stepper = CacheStepper(self._prep.session, self._prep.meta, "chat")
            self.cache = KVCache.for_model(self._prep.path, 1, max_sequence_length, **(cache_options or {}))
        except BaseException:
            self._prep.close()
            raise
        self.max_new_tokens = int(max_new_tokens)
        self._sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self._rng = np.random.default_rng(seed)
        self._log = log
        self._system = system
        self._turns: List[Dict[str, str]] = []   # user/assistant messages after the system prompt
        self._ids: List[int] = []                # exactly what the cache holds
        self._limit = self._positions(self.cache)

    # -- state --------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """The ``onnx_light_ep._text.TextTokenizer`` found next to the model, or None."""
        return self._prep.tokenizer

    @property
    def eos_token_ids(self) -> set:
        return set(self._prep.eos)

    @property
    def max_positions(self) -> int:
        """Most tokens the conversation may hold: ``min(onnx_light.max_position, cache capacity)``."""
        return self._limit

    @property
    def system(self) -> Optional[str]:
        return self._system

    @property
    def messages(self) -> List[Dict[str, str]]:
        """The conversation as chat-template messages (system prompt first, if any)."""
        head = [{"role": "system", "content": self._system}] if self._system is not None else []
        return head + [dict(m) for m in self._turns]

    @property
    def token_ids(self) -> List[int]:
        """The token ids the cache holds (the rendered conversation so far, answers included)."""
        return list(self._ids)

    def _positions(self, cache) -> int:
        limit = self._prep.max_position
        return min(limit, cache.max_sequence_length) if limit else cache.max_sequence_length

    def _note(self, text: str) -> None:
        if self._log is not None:
            self._log(text)

    # -- turns --------------------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, str]]) -> List[int]:
        """Token ids of ``messages`` rendered by the chat template, ending with the assistant header."""
        if self.tokenizer is None:
            raise ValueError("chat: text turns; expected tokenizer.json next to the model (or tokenizer_dir) and "
                             "the tokenizers package, found none: pass token ids to send_ids")
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        except ValueError as e:
            raise ValueError(f"chat: {e}") from e
        return self.tokenizer.encode(text)

    def send(self, text: str, stream: Optional[Callable[[str], None]] = None,
             max_new_tokens: Optional[int] = None) -> ChatTurn:
        """Add the user message ``text``, answer it, and add the answer to the conversation.

        ``stream`` is called with each new piece of the answer's text as it is
        generated. The conversation keeps the answer as shown (a partial one if
        interrupted); a turn interrupted before its answer began leaves the
        conversation as it was.

        Raises:
            ValueError: empty text, no tokenizer or chat template.
            ChatPositionLimitError: the conversation would exceed
                :attr:`max_positions` (nothing changed: :meth:`reset`).
            Whatever a run raises (``KVCacheMemoryError``, ORT errors): the
            cache and the conversation are as before the failed run.
        """
        if not isinstance(text, str) or not text:
            raise ValueError(f"chat: text; expected a non-empty message, got {text!r}")
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.render(messages)
        turn = self.send_ids(ids, stream=stream, max_new_tokens=max_new_tokens)
        if len(self._ids) >= len(ids):   # the prompt is in the cache: the turn happened
            self._turns += [{"role": "user", "content": text}, {"role": "assistant", "content": turn.text or ""}]
        return turn

    def send_ids(self, conversation_ids: Sequence[int], stream: Optional[Callable[[str], None]] = None,
                 max_new_tokens: Optional[int] = None) -> ChatTurn:
        """Answer after ``conversation_ids``: the WHOLE conversation so far as token ids, ready for the answer.

        The ids the cache already holds that are a prefix of
        ``conversation_ids`` are reused; the cache is truncated to the longest
        common prefix otherwise (at least one token is always run, for the
        logits). Then up to ``max_new_tokens`` (default: the session's) answer
        tokens are generated, each run into the cache; the answer stops at an
        end-of-sequence id (not run) or at :attr:`max_positions`. Afterwards
        :attr:`token_ids` is ``conversation_ids`` + the answer (on an interrupt,
        what was run: nothing past a prompt whose run did not finish).

        Args:
            conversation_ids: ints in ``[0, vocab)``, at least one.
            stream: called with each new piece of the answer's text (needs a tokenizer).
            max_new_tokens: int >= 1 or None.

        Returns:
            :class:`ChatTurn`.

        Raises:
            ValueError: empty ids, ids outside the vocabulary, bad ``max_new_tokens``.
            ChatPositionLimitError: ``len(conversation_ids) >= max_positions``
                (no room for an answer; nothing changed).
            Whatever a run raises; the cache then holds :attr:`token_ids`.
        """
        from .generate import sample_next
        from .generate._prepare import _is_int

        if isinstance(conversation_ids, (str, bytes)) or not hasattr(conversation_ids, "__iter__"):
            raise ValueError(f"chat: conversation_ids; expected a sequence of integer token ids, got a "
                             f"{type(conversation_ids).__name__}")
        ids = list(conversation_ids)
        bad = next((t for t in ids if not _is_int(t)), None)
        if bad is not None:   # a float would be truncated, a bool run as 0/1
            raise ValueError(f"chat: conversation_ids; expected integer token ids, got {bad!r}")
        ids = [int(t) for t in ids]
        if max_new_tokens is not None and not _is_int(max_new_tokens):
            raise ValueError(f"chat: max_new_tokens; expected an int >= 1 or None, got {max_new_tokens!r}")
        requested = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if requested < 1:
            raise ValueError(f"chat: max_new_tokens; expected >= 1, got {max_new_tokens}")
        if stream is not None and not callable(stream):
            raise ValueError(f"chat: stream; expected a callable taking each new piece of text, or None, got "
                             f"{type(stream).__name__}")
        if not ids:
            raise ValueError("chat: conversation_ids; expected at least one token id, got []")
        vocab = self._prep.vocab
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"chat: conversation_ids; expected token ids in [0, {vocab}) (the model's vocabulary), "
                             f"got {bad[0]}")
        n = len(ids)
        if n >= self._limit:
            raise ChatPositionLimitError(
                f"chat: the conversation needs {n} tokens before the answer and the model has {self._limit} "
                f"positions (onnx_light.max_position); start over with reset (/reset)", n, self._limit)
        cached = len(self._ids)
        common = _common_prefix(self._ids, ids)
        keep = min(common, n - 1)
        dropped = cached - keep
        budget = min(requested, self._limit - n)
        stop = "max_position" if budget < requested else "max_new_tokens"
        tok, eos = self.tokenizer, self._prep.eos
        shown = ""
        prefill_s = decode_s = 0.0

        def answer() -> List[int]:
            return self._ids[n:]   # every answer token is in the cache and in _ids before it is shown

        def show(final: bool = False) -> None:
            nonlocal shown
            if stream is None or tok is None:
                return
            text = tok.decode(answer())
            if text.startswith(shown) and len(text) > len(shown) and (final or not text.endswith("\ufffd")):
                piece, shown = text[len(shown):], text
                stream(piece)

        try:
            if common < cached:
                self._note(f"chat: the rendering differs from the cached tokens at token {common} of {cached} (the "
                           f"template re-rendered earlier turns differently); truncated the cache to {keep} tokens, "
                           f"running {n - keep}")
            if dropped:   # a mismatch, or the whole input cached: its last token is re-run for the logits
                self.cache.truncate(keep)
                del self._ids[keep:]
            t0 = time.perf_counter()
            logits = self._stepper.prefill(self.cache, np.array([ids[keep:]], dtype=np.int64))
            self._ids[keep:] = ids[keep:]
            prefill_s = time.perf_counter() - t0
            for _ in range(budget):
                t = int(sample_next(logits, rng=self._rng, **self._sampling)[0])
                if t in eos:
                    stop = "eos"
                    break
                t0 = time.perf_counter()
                logits = self._stepper.run(self.cache, np.array([[t]], dtype=np.int64))[:, -1]
                self._ids.append(t)
                decode_s += time.perf_counter() - t0
                show()
        except KeyboardInterrupt:
            stop = "interrupted"
            self._reconcile()
        except BaseException:
            self._reconcile()
            raise
        prompt_ran = len(self._ids) >= n
        out = answer() if prompt_ran else []
        show(final=True)
        return ChatTurn(token_ids=out, text=tok.decode(out) if tok is not None else None, stop_reason=stop,
                        appended_tokens=n - keep if prompt_ran else 0, cached_tokens=keep, dropped_tokens=dropped,
                        context_tokens=len(self._ids), prefill_seconds=prefill_s, decode_seconds=decode_s)

    def _reconcile(self) -> None:
        """After an interrupted or failed run: make the cache hold exactly ``_ids`` again.

        A run that committed before the interrupt reached Python left one more
        run in the cache than ``_ids`` records: truncated away.
        """
        held = self._stepper.past_length(self.cache)
        if held > len(self._ids):
            self.cache.truncate(len(self._ids))
        elif held < len(self._ids):
            del self._ids[held:]

    # -- reset, save, load ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty the cache (``KVCache.reset``)."""
        self.cache.reset()
        self._ids = []
        self._turns = []

    def save(self, path) -> None:
        """Write the cache to ``path`` (``KVCache.save``) and the conversation to ``path + ".json"``.

        The JSON holds ``format`` (``"onnx_light_ep.chat"``), ``version``,
        ``system``, ``messages`` (user/assistant turns), ``token_ids`` (what the
        cache holds), ``model`` (the path, informative) and ``digest``: the
        hex sha256 of the cache file's bytes followed by the token ids as
        int64 little-endian, which binds the two files (:meth:`load` checks
        it). The cache is written first, then the JSON; each to a temporary
        name and renamed (a failure in between leaves a JSON whose digest does
        not match: refused by :meth:`load`).

        Raises:
            OSError: the files cannot be written.
        """
        path = os.fspath(path)
        side = path + ".json"
        self.cache.save(path)
        data = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "model": os.path.abspath(self._prep.path),
                "system": self._system, "messages": [dict(m) for m in self._turns], "token_ids": list(self._ids),
                "digest": _digest(path, self._ids)}
        tmp = side + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=1)
            os.replace(tmp, side)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def load(self, path) -> None:
        """Replace the conversation and the cache with those :meth:`save` wrote to ``path`` (+ ``.json``).

        Checked before anything changes: the JSON (format, version, messages,
        token ids in the vocabulary, digest), the cache file (``KVCache.load``:
        magic, version, checksum, ...), that its geometry is this model's
        (layers, batch 1, kv heads, head sizes, dtype, sliding windows), that
        it holds as many tokens as the JSON lists and that the JSON's
        ``digest`` is that of this cache file and these token ids (an edited
        ``token_ids`` or the JSON of another save would leave the cache
        holding K/V of other tokens than the conversation says). The loaded cache takes its pages from the
        current cache's pool and keeps the page size, quantization and
        capacity it was saved with (:attr:`max_positions` follows the capacity).

        Raises:
            ValueError: any check failed (the text names the file and what
                differs); the current conversation and cache are kept.
        """
        from . import KVCache

        path = os.fspath(path)
        side = path + ".json"
        try:
            with open(side, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"chat.load: {side!r}; expected the conversation /save writes next to the cache file, "
                             f"got {type(e).__name__}: {e}") from None
        system, turns, ids, digest = self._check_sidecar(data, side)
        cache = KVCache.load(path, pool=self.cache.pool)
        try:
            for key in _GEOMETRY:
                got, want = getattr(cache, key), getattr(self.cache, key)
                if got != want:
                    raise ValueError(f"chat.load: {path!r} holds a cache of another model: {key} {got}, expected "
                                     f"{want} (this model's); the current conversation is kept")
            held = int(cache.seq_lens[0])
            if held != len(ids):
                raise ValueError(f"chat.load: {path!r} holds {held} tokens but {side!r} lists {len(ids)} token ids; "
                                 f"expected the pair /save wrote; the current conversation is kept")
            if not (isinstance(digest, str) and len(digest) == 64):
                raise ValueError(f"chat.load: {side!r}; expected \"digest\": the sha256 /save writes (of the cache "
                                 f"file and the token ids), got {digest!r}; the current conversation is kept")
            if _digest(path, ids) != digest:   # the K/V of other tokens than the listed ones
                raise ValueError(f"chat.load: {side!r} does not describe {path!r} (sha256 of the cache file and the "
                                 f"token ids differs from its \"digest\"); expected the pair /save wrote; the "
                                 f"current conversation is kept")
        except BaseException:
            cache.close()
            raise
        old, self.cache = self.cache, cache
        old.close()
        self._system, self._turns, self._ids = system, turns, ids
        self._limit = self._positions(cache)

    def _check_sidecar(self, data, side: str):
        def bad(what: str):
            return ValueError(f"chat.load: {side!r}; expected {what}; the current conversation is kept")

        if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
            raise bad(f'a JSON object with "format": "{SIDECAR_FORMAT}"')
        if data.get("version") != SIDECAR_VERSION:
            raise bad(f'"version": {SIDECAR_VERSION}, got {data.get("version")!r}')
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise bad('"system": text or null')
        turns = data.get("messages")
        if not isinstance(turns, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in turns):
            raise bad('"messages": a list of {"role": text, "content": text}')
        ids = data.get("token_ids")
        vocab = self._prep.vocab
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad('"token_ids": a list of ints')
        out = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if out:
            raise bad(f'"token_ids" in [0, {vocab}) (the model\'s vocabulary), got {out[0]}')
        return system, [{"role": m["role"], "content": m["content"]} for m in turns], list(ids), data.get("digest")

    def close(self) -> None:
        """Release the cache and a temporary conversion. Idempotent."""
        if getattr(self, "cache", None) is not None:
            self.cache.close()
        self._prep.close()

    def __enter__(self) -> "ChatSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

