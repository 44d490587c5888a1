"""Per-layer sliding windows from the Hugging Face ``config.json`` an exporter wrote next to the model.

Exports that build the window into the attention mask (torch.onnx dynamo,
optimum: a banded causal mask) carry no window attribute the cache can use to
release old pages. transformers' config names it: ``sliding_window`` (keys a
query sees, including itself) and, per layer, ``layer_types``
(``"sliding_attention"`` / ``"full_attention"``: Gemma-2/3, Qwen2 with
``use_sliding_window``, Mistral in transformers 5); a config without
``layer_types`` but with ``sliding_window`` set and ``use_sliding_window`` not
false (Mistral/Mixtral in transformers 4) applies it to every layer. Multimodal
configs nest the decoder's under ``text_config``.

The window then becomes the layer's ``local_window_size`` next to the graph's
own mask: the kernel applies both, so a window equal to the mask's changes no
output (``compare`` shows it) and lets ``KVCache.for_model`` evict; a window
larger than the mask's keeps more pages than needed; a smaller one changes
outputs (``compare`` fails), which is why a window already in the graph wins.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional

__all__ = ["MAX_WINDOW", "config_windows"]

#: the longest sequence a KVCache holds (its max_sequence_length limit): a longer window never evicts, and
#: KVCache refuses it as a layer's sliding_window
MAX_WINDOW = 1 << 24


def config_windows(model_dir: str) -> Optional[List[Optional[int]]]:
    """Window per layer (None = full attention) from ``model_dir/config.json``, or None when it names none.

    Raises nothing: a missing, unreadable or unrelated config gives None, and so does a window longer than
    :data:`MAX_WINDOW` (no sequence reaches it: the layers attend to every position).
    """
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if window > MAX_WINDOW:   # longer than any sequence: full attention (and no cache could take it)
        return None
    if cfg.get("use_sliding_window") is False:
        return None
    types = cfg.get("layer_types")
    n = cfg.get("num_hidden_layers")
    if isinstance(types, list) and types:
        if isinstance(n, int) and len(types) != n:
            return None
        return [window if t == "sliding_attention" else None for t in types]
    if isinstance(n, int) and n > 0 and cfg.get("model_type") in ("mistral", "mixtral"):
        return [window] * n
    return None
