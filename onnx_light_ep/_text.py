"""Tokenizer, chat template and end-of-sequence ids found next to a model.

Optional: a model folder may hold ``tokenizer.json`` (Hugging Face
``tokenizers`` format), ``tokenizer_config.json``, ``chat_template.jinja``,
``genai_config.json`` / ``generation_config.json`` / ``config.json``. The
``tokenizers`` package reads the first (``transformers`` is used instead when
``tokenizers`` is missing); ``jinja2`` renders the chat template. Without them
callers pass token ids.
"""

from __future__ import annotations

import json
import os
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set

__all__ = ["TextTokenizer", "eos_token_ids"]


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _as_ids(value) -> Set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value if isinstance(v, int)}
    return set()


def eos_token_ids(*folders: str) -> Set[int]:
    """End-of-sequence token ids declared by the config files in ``folders`` (may be empty)."""
    ids: Set[int] = set()
    for d in folders:
        if not d:
            continue
        genai = _read_json(os.path.join(d, "genai_config.json")).get("model", {})
        ids |= _as_ids(genai.get("eos_token_id"))
        ids |= _as_ids(_read_json(os.path.join(d, "generation_config.json")).get("eos_token_id"))
        ids |= _as_ids(_read_json(os.path.join(d, "config.json")).get("eos_token_id"))
    return ids


_MAX_LOADED = 8
_LOADED: Dict[tuple, "TextTokenizer"] = {}


def _files_key(folder: str) -> tuple:
    """(real path, (size, mtime_ns) of each tokenizer file or None): a changed file is a new key."""
    parts = []
    for name in ("tokenizer.json", "tokenizer_config.json", "genai_config.json", "generation_config.json",
                 "config.json"):
        try:
            st = os.stat(os.path.join(folder, name))
            parts.append((st.st_size, st.st_mtime_ns))
        except OSError:
            parts.append(None)
    return (os.path.realpath(folder), tuple(parts))


class TextTokenizer:
    """Text ⇄ token ids for one model folder.

    Construct with :meth:`find`. ``encode`` adds no special tokens (chat
    templates write their own); ``decode`` skips special tokens.
    """

    def __init__(self, folder: str, backend, kind: str):
        self.folder = folder
        self._tok = backend
        self._kind = kind
        self._config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        ids = eos_token_ids(folder)
        eos = self._config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            tid = self.token_to_id(eos)
            if tid is not None:
                ids.add(tid)
        # frozen: one loaded tokenizer serves every call in the process (find())
        self.eos_token_ids: FrozenSet[int] = frozenset(ids)

    @classmethod
    def find(cls, folders: Iterable[str]) -> Optional["TextTokenizer"]:
        """The tokenizer of the first folder holding ``tokenizer.json``, or None.

        None also when neither ``tokenizers`` nor ``transformers`` is installed. A folder's
        tokenizer is loaded once per process and reused while its files are unchanged (same
        size and modification time of tokenizer.json and tokenizer_config.json): parsing
        SmolLM2's tokenizer.json takes ~0.2 s, which every generate() call paid before.
        """
        for d in folders:
            if not d or not os.path.isfile(os.path.join(d, "tokenizer.json")):
                continue
            key = _files_key(d)
            hit = _LOADED.get(key)
            if hit is not None:
                return hit
            tok = cls._load(d)
            if tok is not None:
                while len(_LOADED) >= _MAX_LOADED:
                    _LOADED.pop(next(iter(_LOADED)))
                _LOADED[key] = tok
            return tok
        return None

    @classmethod
    def _load(cls, d: str) -> Optional["TextTokenizer"]:
        try:
            from tokenizers import Tokenizer

            return cls(d, Tokenizer.from_file(os.path.join(d, "tokenizer.json")), "tokenizers")
        except ImportError:
            pass
        try:
            from transformers import AutoTokenizer

            return cls(d, AutoTokenizer.from_pretrained(d), "transformers")
        except Exception:
            return None

    def token_to_id(self, token: str) -> Optional[int]:
        if self._kind == "tokenizers":
            return self._tok.token_to_id(token)
        tid = self._tok.convert_tokens_to_ids(token)
        return tid if isinstance(tid, int) else None

    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included."""
        if self._kind == "tokenizers":
            return int(self._tok.get_vocab_size(with_added_tokens=True))
        return int(len(self._tok))

    def encode(self, text: str) -> List[int]:
        if self._kind == "tokenizers":
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self) -> List[int]:
        """The special ids the tokenizer's own post-processor puts before a plain text (Gemma:
        ``[<bos>]``; SmolLM2: none), for callers that feed a text without a chat template."""
        if self._kind == "tokenizers":
            plain = list(self._tok.encode("a", add_special_tokens=False).ids)
            full = list(self._tok.encode("a", add_special_tokens=True).ids)
        else:
            plain = list(self._tok("a", add_special_tokens=False)["input_ids"])
            full = list(self._tok("a", add_special_tokens=True)["input_ids"])
        k = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        return full[:k]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._kind == "tokenizers":
            return self._tok.decode(ids, skip_special_tokens=True)
        return self._tok.decode(ids, skip_special_tokens=True)

    def chat_template(self) -> Optional[str]:
        path = os.path.join(self.folder, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
        t = self._config.get("chat_template")
        return t if isinstance(t, str) else None

    def chat_prompt(self, question: str, system: Optional[str] = None) -> Optional[str]:
        """``question`` as one user turn of the chat template, ready for the assistant; None without a template
        (or without ``jinja2``).

        ``system``: text of a system turn before it (None: the template's default, if it has one).
        """
        if self.chat_template() is None:
            return None
        try:
            import jinja2  # noqa: F401
        except ImportError:
            return None
        return self.render_chat(([{"role": "system", "content": system}] if system is not None else [])
                                + [{"role": "user", "content": question}])

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The whole conversation ``messages`` (dicts with ``role`` and ``content``) rendered by the chat template.

        ``add_generation_prompt``: end with the template's assistant header (the
        model answers next). Rendered as ``transformers``' ``apply_chat_template``
        does (jinja2 with ``trim_blocks``/``lstrip_blocks``; ``bos_token``,
        ``eos_token`` from ``tokenizer_config.json``; ``raise_exception``).

        Raises:
            ValueError: no chat template (``chat_template.jinja`` or
                ``tokenizer_config.json``'s ``chat_template``), ``jinja2`` not
                installed, or the template itself raised.
        """
        template = self.chat_template()
        if template is None:
            raise ValueError(f"chat template; expected chat_template.jinja or a chat_template entry of "
                             f"tokenizer_config.json in {self.folder!r}, found neither")
        try:
            import jinja2
        except ImportError:
            raise ValueError("chat template; rendering it needs the jinja2 package, which is not installed") from None

        def raise_exception(msg):
            raise ValueError(msg)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception

        def tok(name):
            v = self._config.get(name)
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        return env.from_string(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            bos_token=tok("bos_token"), eos_token=tok("eos_token"))
