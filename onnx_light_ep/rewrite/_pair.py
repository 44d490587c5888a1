"""Prefill/decode pairs: two graphs of one export that run on one ``KVCache``.

transformers' exporter (``transformers.exporters.OnnxExporter.export_for_generation``,
``save_pretrained``) writes a folder holding ``prefill.onnx`` (no past input:
its presents ``cache.layers.N.keys``/``values`` start the cache) and
``decode.onnx`` (pasts ``input.cache.layers.N.keys``/``values``, presents
``output.cache.layers.N.keys``/``values``). Step 0 of a generation runs the
prefill graph, every later step the decode graph, and each present of one run
is the matching past of the next.

Converted, both graphs take the same cache input and append to the same
layers: ``convert`` on such a folder converts both into an output folder
(``stage="prefill"`` and ``"decode"``, recorded as ``onnx_light.stage``), the
prefill graph's presents removed (they start the cache the decode graph
continues). :func:`check_pair_metadata` states what the two must agree on,
and :func:`model_files` reads the forms a caller may give (one file, a folder
holding the pair, or two paths).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

PREFILL_FILE, DECODE_FILE = "prefill.onnx", "decode.onnx"
#: metadata entries the two converted graphs of a pair must share (one KVCache serves both)
PAIR_KEYS = ("num_layers", "kv_num_heads", "head_dim", "v_head_dim", "dtype", "cache_input", "padding_side",
             "max_position")

__all__ = ["DECODE_FILE", "PAIR_KEYS", "PREFILL_FILE", "PairReport", "check_pair_metadata", "convert_pair",
           "model_files"]


def pair_in_folder(path: str) -> Optional[Tuple[str, str]]:
    """``(prefill, decode)`` paths if the folder ``path`` holds both files, else None."""
    p, d = os.path.join(path, PREFILL_FILE), os.path.join(path, DECODE_FILE)
    return (p, d) if os.path.isfile(p) and os.path.isfile(d) else None


def model_files(model: Any, where: str, arg: str = "model") -> Tuple[str, Optional[str]]:
    """``(path, decode_path or None)`` for one model or a prefill/decode pair.

    ``model`` is an ONNX file, a folder holding ``prefill.onnx`` and
    ``decode.onnx``, or a sequence of two files ``(prefill, decode)``.

    Raises:
        FileNotFoundError: a file that does not exist, or a folder without the pair
            (the message names ``arg``).
        ValueError: a sequence that is not two paths.
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 2:
            raise ValueError(f"{where}: {arg}; expected one ONNX file, a folder holding {PREFILL_FILE} and "
                             f"{DECODE_FILE}, or two paths (prefill, decode), got {len(model)} paths")
        paths = [os.fspath(m) for m in model]
        for name, p in zip(("prefill", "decode"), paths):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{where}: {arg} ({name}); expected an ONNX file, got {p!r} "
                                        f"({'a folder' if os.path.isdir(p) else 'not found'})")
        if os.path.realpath(paths[0]) == os.path.realpath(paths[1]):
            raise ValueError(f"{where}: {arg}; expected two different files (prefill, decode), got {paths[0]!r} "
                             "twice")
        return paths[0], paths[1]
    path = os.fspath(model)
    if os.path.isdir(path):
        pair = pair_in_folder(path)
        if pair is None:
            raise FileNotFoundError(f"{where}: {arg}; expected an ONNX file or a folder holding {PREFILL_FILE} and "
                                    f"{DECODE_FILE}, got {path!r} (a folder)")
        return pair
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where}: {arg}; expected an ONNX file, got {path!r} (not found)")
    return path, None


def check_pair_metadata(prefill: Dict[str, Any], decode: Dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` unless two converted graphs can run on one ``KVCache`` as prefill and decode.

    They must agree on :data:`PAIR_KEYS` and on each layer's ``local_window_size``, keep no
    past as a tensor (``tensor_pairs`` empty), not be marked for the other role
    (``onnx_light.stage``), and every layer of the decode graph must have had a past input
    (a graph without pasts starts a cache: given as the decode graph, the files are swapped).
    """
    for meta, want in ((prefill, "prefill"), (decode, "decode")):
        got = meta.get("stage")
        if got not in (None, want):
            raise ValueError(f"{where}: the {want} graph is marked onnx_light.stage={got!r}; expected {want!r} "
                             f"(pass the graphs in the order prefill, decode)")
        if meta.get("tensor_pairs"):
            raise ValueError(f"{where}: the {want} graph still carries past/present tensors "
                             f"{meta['tensor_pairs'][0]} outside the cache (a layer convert left as it was); a pair "
                             f"needs every layer in the cache")
    for i, layer in enumerate(decode.get("layers") or []):
        if "past_key" in layer and not layer["past_key"]:   # a graph that starts a cache cannot continue one
            raise ValueError(f"{where}: the decode graph's layer {i} has no past input (pattern "
                             f"{layer.get('pattern')!r}): a decode graph continues the cache the prefill graph "
                             f"started; expected {DECODE_FILE} to take the pasts (are {PREFILL_FILE} and "
                             f"{DECODE_FILE} swapped?)")
    bad = [(k, prefill.get(k), decode.get(k)) for k in PAIR_KEYS if prefill.get(k) != decode.get(k)]
    windows = [[x.get("local_window_size", -1) for x in m.get("layers", [])] for m in (prefill, decode)]
    if windows[0] != windows[1]:
        bad.append(("layers[].local_window_size", windows[0], windows[1]))
    keep = [m.get("logits_to_keep") for m in (prefill, decode)]
    if bool(keep[0]) != bool(keep[1]):  # the loops feed one graph's inputs by the other's metadata
        bad.append(("logits_to_keep", keep[0], keep[1]))
    if bad:
        what = "; ".join(f"{k}: prefill {a!r}, decode {b!r}" for k, a, b in bad)
        raise ValueError(f"{where}: the prefill and decode graphs cannot share one KVCache: their metadata "
                         f"disagree ({what}); convert both graphs of one export with the same options")


@dataclass
class PairReport:
    """What ``convert`` did to the two graphs of a folder (each a ``ConvertReport``)."""

    input_dir: str
    output_dir: str
    prefill: Any
    decode: Any

    def to_dict(self) -> Dict[str, Any]:
        return {"input_dir": self.input_dir, "output_dir": self.output_dir, "prefill": self.prefill.to_dict(),
                "decode": self.decode.to_dict()}

    def __str__(self) -> str:
        return (f"converted the prefill/decode pair {self.input_dir} -> {self.output_dir} "
                f"(one KVCache: {self.decode.num_layers} layers, cache input {self.decode.cache_input!r})\n"
                f"{self.prefill}\n{self.decode}")


def convert_stages(srcs: Dict[str, str], dsts: Dict[str, str], *,
                   keep_present: Optional[Dict[str, Sequence[str]]] = None, logits_to_keep: bool = False,
                   **kwargs) -> Dict[str, Any]:
    """Convert the two graphs of a pair, ``srcs[stage]`` -> ``dsts[stage]`` for stage ``prefill`` and
    ``decode``, each in its role (``convert(..., stage=stage)``); returns their ``ConvertReport`` by stage.

    With ``logits_to_keep`` both converted graphs take that input or neither: the loops feed one
    graph's inputs by the other's metadata (:func:`check_pair_metadata` refuses a mismatch). When
    one graph's LM head is not found, the other is converted again without it, with a note
    saying why. ``keep_present`` per stage; ``kwargs`` go to every ``convert``.
    """
    from ._api import convert

    keep_present = keep_present or {}

    def one(stage: str, keep_logits: bool):
        return convert(srcs[stage], dsts[stage], keep_present=keep_present.get(stage, ()), stage=stage,
                       logits_to_keep=keep_logits, **kwargs)

    reports = {stage: one(stage, logits_to_keep) for stage in ("prefill", "decode")}
    took = {st: bool(r.metadata.get("logits_to_keep")) for st, r in reports.items()}
    if took["prefill"] != took["decode"]:
        other = "decode" if took["prefill"] else "prefill"
        why = next((n for n in reports[other].notes if n.startswith("no logits_to_keep input")), "")
        redo = "prefill" if took["prefill"] else "decode"
        reports[redo] = one(redo, False)
        reports[redo].notes.append(f"converted without logits_to_keep, as the {other} graph is ({why})")
    return reports


def convert_pair(src_dir: str, dst_dir: str, *, keep_present: Sequence[str] = (),
                 sliding_window: Optional[int] = None, cache_input: str = "kv_cache", check: bool = True,
                 logits_to_keep: bool = False) -> PairReport:
    """Convert ``src_dir/{prefill,decode}.onnx`` into ``dst_dir`` (see the module docstring).

    Both are written into a temporary folder inside ``dst_dir`` and moved into place only when
    both converted and :func:`check_pair_metadata` accepts them: a failure leaves no output.
    """
    from ._api import ConvertError
    from ._metadata import read_metadata

    pair = pair_in_folder(src_dir)
    if pair is None:
        raise FileNotFoundError(f"convert: input_path; expected an ONNX file or a folder holding {PREFILL_FILE} and "
                                f"{DECODE_FILE}, got {src_dir!r} (a folder)")
    if os.path.isfile(dst_dir):
        raise ConvertError(f"convert: output_path; expected a folder for the converted pair (input {src_dir!r} is "
                           f"a folder), got the file {dst_dir!r}")
    if os.path.realpath(src_dir) == os.path.realpath(dst_dir):
        raise ConvertError(f"convert: output_path; expected a folder other than the input folder, got {dst_dir!r}")
    import onnx

    outputs = {}
    for src in pair:
        try:
            outputs[src] = {o.name for o in onnx.load(src, load_external_data=False).graph.output}
        except Exception:  # unreadable: the convert of that file says so
            outputs[src] = set()
    for k in keep_present:
        if not any(k in o for o in outputs.values()):
            raise ConvertError(f"convert: keep_present; expected output names of {PREFILL_FILE} or {DECODE_FILE}, "
                               f"got {k!r}")
    created = not os.path.isdir(dst_dir)
    os.makedirs(dst_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".onnx_light_pair_", dir=dst_dir)
    try:
        srcs = dict(zip(("prefill", "decode"), pair))
        reports = convert_stages(srcs, {st: os.path.join(tmp, os.path.basename(src)) for st, src in srcs.items()},
                                 keep_present={st: [k for k in keep_present if k in outputs[src]]
                                               for st, src in srcs.items()},
                                 sliding_window=sliding_window, cache_input=cache_input, check=check,
                                 logits_to_keep=logits_to_keep)
        try:
            check_pair_metadata(*(read_metadata(reports[s].output_path) for s in ("prefill", "decode")), "convert")
        except ValueError as e:
            raise ConvertError(str(e)) from None
        models = {os.path.basename(reports[s].output_path) for s in reports}
        for name in sorted(os.listdir(tmp), key=lambda n: n in models):  # the model files last
            if name in models or name.endswith(".onnx.data") or not os.path.lexists(os.path.join(dst_dir, name)):
                os.replace(os.path.join(tmp, name), os.path.join(dst_dir, name))  # tokenizer files: only new ones
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not os.listdir(dst_dir):
            os.rmdir(dst_dir)
    for stage, r in reports.items():
        r.output_path = os.path.join(dst_dir, os.path.basename(r.output_path))
        r.notes = [n for n in r.notes if not n.startswith("created the output folder")]
        r.notes = [n.replace(tmp, dst_dir) for n in r.notes]
    if created:
        reports["prefill"].notes.append(f"created the output folder {os.path.abspath(dst_dir)}")
    return PairReport(input_dir=src_dir, output_dir=dst_dir, prefill=reports["prefill"], decode=reports["decode"])
