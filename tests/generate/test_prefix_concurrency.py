"""One PrefixCache shared by threads: two models, two sessions each, requests on two threads while a third
clears and evicts; and a PrefixCache closed while a request runs. Every request gives its uncached tokens,
and once everything is closed the pool holds nothing."""
import random
import threading

import onnxruntime as ort
import pytest

from onnx_light_ep import InferenceSession, KVPool
from onnx_light_ep.generate import PrefixCache, generate

KW = dict(do_rotary=True, d=16)


def _session(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return InferenceSession(path, so)


@pytest.mark.parametrize("max_bytes", [None, 1_600_000])
def test_two_threads_two_models_and_a_racing_clear(mini_decoder, max_bytes):
    a = mini_decoder(name="a", seed=0, **KW)[1]
    b = mini_decoder(name="b", seed=1, **KW)[1]
    rng = random.Random(0)
    heads = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    requests = [(rng.choice([a, b]), rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))])
                for _ in range(40)]
    want = {(m, tuple(p)): generate(m, prompt_ids=[p], max_new_tokens=6, threads=1).token_ids for m, p in requests}
    pool = KVPool()
    pc = PrefixCache(pool, block_tokens=32, max_bytes=max_bytes)
    sessions = {m: [_session(m), _session(m)] for m in (a, b)}
    errors, cached = [], []
    stop = threading.Event()

    def worker(i):
        try:
            for m, p in requests[i::2]:
                got = generate(m, prompt_ids=[p], max_new_tokens=6, session=sessions[m][i], prefix_cache=pc)
                cached.append(got.cached_tokens)
                if got.token_ids != want[(m, tuple(p))]:
                    errors.append(("tokens differ", m, p, got.cached_tokens))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    def clearer():
        while not stop.wait(0.01):
            pc.clear()
            pc.evict()
            pc.stats()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    racer = threading.Thread(target=clearer)
    for t in threads + [racer]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    racer.join()
    assert not errors, errors
    assert len(cached) == len(requests)
    pc.close()
    assert pool.stats()["live_bytes"] == 0 and pool.stats()["num_caches"] == 0, pool.stats()
    pool.close()


class _ClosingSession:
    """An EP session that closes a PrefixCache during its first run (between match and insert)."""

    def __init__(self, path, pc):
        self._s, self._pc, self.runs = _session(path), pc, 0

    def __getattr__(self, name):
        return getattr(self._s, name)

    def run(self, names, feeds, *a, **kw):
        self.runs += 1
        if self.runs == 1:
            self._pc.close()
        return self._s.run(names, feeds, *a, **kw)


def test_a_request_running_while_its_prefix_cache_is_closed_completes(mini_decoder):
    """close() on another thread while a request prefills: the request keeps its own cache and finishes (it
    raised 'PrefixCache.insert: the PrefixCache is closed' after its prefill and lost its tokens); nothing is
    left in the closed PrefixCache or the pool; a later request is refused by name."""
    dst = mini_decoder(**KW)[1]
    prompt = list(range(3, 43))
    want = generate(dst, prompt_ids=[prompt], max_new_tokens=5, threads=1)
    pool = KVPool()
    pc = PrefixCache(pool, block_tokens=32)
    got = generate(dst, prompt_ids=[prompt], max_new_tokens=5, session=_ClosingSession(dst, pc), prefix_cache=pc)
    assert got.token_ids == want.token_ids and pc.closed and len(pc) == 0
    assert pool.stats()["live_bytes"] == 0 and pool.stats()["num_caches"] == 0
    with pytest.raises(ValueError, match=r"PrefixCache.match: the PrefixCache is closed"):
        generate(dst, prompt_ids=[prompt], max_new_tokens=5, prefix_cache=pc)
    pool.close()
