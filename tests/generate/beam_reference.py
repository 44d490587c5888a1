"""A reference beam search for the tests: transformers' tensor algorithm written out in numpy, driven by
plain ONNX Runtime on an unconverted model whose pasts are gathered per beam (``present[parent_beams]``).

It follows ``GenerationMixin._beam_search`` of transformers 5.x step by step, with its sentinel
arithmetic (``-1e9`` masks, the top-``K`` of (beam, vocab), ``merged`` finished hypotheses, the
early-stop heuristic over all slots), so it shares no code and no structure with
``onnx_light_ep.generate._beam`` (which keeps an explicit list of hypotheses). Ties are broken by
index (stable sorts), as ``_beam`` does.
"""
import numpy as np
import onnxruntime as ort

NEG = -1.0e9


def _so():
    s = ort.SessionOptions()
    s.log_severity_level = 3
    return s


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _topk(values, k):
    order = np.argsort(-values, kind="stable")[:k]
    return values[order], order


class GatheredPastModel:
    """An unconverted GroupQueryAttention decoder on plain ORT with explicit past/present tensors.

    ``run(ids [B, S])`` appends ``ids`` and returns the last position's float32 logits ``[B, V]``;
    ``gather(parents)`` selects the pasts of the next step's beams (a copy of every past row,
    counted in ``gathered_bytes``)."""

    def __init__(self, path):
        self.sess = ort.InferenceSession(path, _so(), providers=["CPUExecutionProvider"])
        self.pasts = {i.name: i for i in self.sess.get_inputs() if i.name.startswith("past_")}
        self.out_names = [o.name for o in self.sess.get_outputs()]
        self.values = None
        self.gathered_bytes = []

    def run(self, ids):
        ids = np.asarray(ids, np.int64)
        b = ids.shape[0]
        if self.values is None:
            self.values = {n: np.zeros((b, i.shape[1], 0, i.shape[3]), np.float32) for n, i in self.pasts.items()}
        past = next(iter(self.values.values())).shape[2]
        feeds = {"input_ids": ids, "attention_mask": np.ones((b, past + ids.shape[1]), np.int64)}
        feeds.update(self.values)
        outs = dict(zip(self.out_names, self.sess.run(None, feeds)))
        self.values = {n: outs[n.replace("past_", "present_")] for n in self.values}
        return outs["logits"][:, -1]

    def gather(self, parents):
        self.values = {n: v[parents] for n, v in self.values.items()}
        self.gathered_bytes.append(sum(v.nbytes for v in self.values.values()))


def reference_beam_search(model, prompt, num_beams, eos_token_ids, max_new_tokens, length_penalty=1.0,
                          early_stopping=False):
    """transformers' beam search for one prompt; returns ``(hypotheses, num_decode_runs)``.

    ``hypotheses``: the ``num_beams`` finished ones, best first, as ``(token_ids_without_eos, ended_on_eos,
    score)``."""
    n, eos = num_beams, np.array(sorted(eos_token_ids), np.int64)
    k = max(2, 1 + len(eos)) * n
    logits = np.repeat(model.run(np.array([prompt])), n, axis=0)   # transformers prefills N copies
    model.gather(np.zeros(n, np.int64))
    vocab = logits.shape[-1]
    running_seq = np.zeros((n, max_new_tokens), np.int64)
    running_scores = np.full(n, NEG)
    running_scores[0] = 0.0
    seqs = np.zeros((n, max_new_tokens), np.int64)
    seq_lens = np.zeros(n, np.int64)
    beam_scores = np.full(n, NEG)
    is_finished = np.zeros(n, bool)
    unsatisfied = True
    cur, runs = 0, 0
    while True:
        acc = (_log_softmax(logits) + running_scores[:, None]).reshape(-1)
        topk_scores, idx = _topk(acc, k)
        beam, tok = idx // vocab, idx % vocab
        topk_seq = running_seq[beam].copy()
        topk_seq[:, cur] = tok
        hits = np.isin(tok, eos) | (cur + 1 >= max_new_tokens)
        # e. running beams of the next iteration
        run_scores = topk_scores + hits * NEG
        run_scores_n, nxt = _topk(run_scores, n)
        # f. finished beams
        did = hits & (np.arange(k) < n)
        fin = topk_scores / float(cur + 1) ** length_penalty
        fin = fin + (is_finished.all() and early_stopping is True) * NEG + (not unsatisfied) * NEG + (~did) * NEG
        merged_seq = np.concatenate([seqs, topk_seq])
        merged_len = np.concatenate([seq_lens, np.full(k, cur + 1)])
        merged_scores = np.concatenate([beam_scores, fin])
        merged_fin = np.concatenate([is_finished, did])
        beam_scores, sel = _topk(merged_scores, n)
        seqs, seq_lens, is_finished = merged_seq[sel], merged_len[sel], merged_fin[sel]
        running_seq, running_scores, parents = topk_seq[nxt], run_scores_n, beam[nxt]
        cur += 1
        # g. stopping
        best_len = max_new_tokens if (early_stopping == "never" and length_penalty > 0) else cur
        best = running_scores[0] / float(best_len) ** length_penalty
        worst = np.where(is_finished, beam_scores.min(), NEG)
        unsatisfied = unsatisfied and bool(np.any(best > worst))
        go_on = unsatisfied and not (is_finished.all() and early_stopping is True) and not hits.all()
        if not go_on:
            break
        model.gather(parents)
        logits = model.run(running_seq[:, cur - 1:cur])
        runs += 1
    out = []
    for row, length, score in zip(seqs, seq_lens, beam_scores):
        ids = row[:length].tolist()
        ended = bool(ids) and ids[-1] in eos
        out.append((ids[:-1] if ended else ids, ended, float(score)))
    return out, runs
