"""PrefixCache on the mini decoder: reuse across prompts equals an uncached run, boundaries, eviction, keys."""
import os

import numpy as np
import pytest

import rw_harness as H
from onnx_light_ep import InferenceSession, KVCache, KVPool
from onnx_light_ep.generate import CacheStepper, PrefixCache, generate
from onnx_light_ep.rewrite import read_metadata

B = 32  # block_tokens = the pool's page_tokens: entries share whole pages
ATOL = 1e-5  # fp32 logits of the mini decoder (|logits| < 10): same arithmetic, other row blocking
ROTARY = dict(do_rotary=True, d=16, max_pos=512)


def _ids(seed, n):
    return np.random.default_rng(seed).integers(0, 50, n).tolist()


def _gen(model, ids, pc=None, n=12, **kw):
    return generate(model, prompt_ids=[ids], max_new_tokens=n, eos_token_ids=[], prefix_cache=pc, **kw)


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _expected_cached(prompt, seen, block=B):
    """Reference: the longest whole-block prefix shared with an earlier prompt, at most len - 1."""
    shared = max([_common(prompt, q) for q in seen], default=0)
    return min(shared // block * block, len(prompt) - 1)


def test_many_prompts_sharing_prefixes_give_the_uncached_tokens(mini_decoder):
    """Prompts sharing a system prefix, and each other's prefixes, at many lengths: greedy ids of an uncached
    run, and exactly the reused length the block rule gives."""
    _, dst = mini_decoder(**ROTARY)
    system = _ids(0, 100)
    prompts = [system + _ids(1, 7), system + _ids(2, 40), system[:64] + _ids(3, 9), system + _ids(2, 40)[:20],
               system[:31] + _ids(4, 50), _ids(5, 70), system + _ids(1, 7) + _ids(6, 30), system[:96]]
    with KVPool(page_tokens=B) as pool, PrefixCache(pool) as pc:
        seen = []
        for p in prompts:
            got = _gen(dst, p, pc)
            assert got.cached_tokens == _expected_cached(p, seen), (len(p), seen and len(seen))
            assert got.token_ids == _gen(dst, p).token_ids
            seen.append(p)
        s = pc.stats()
        assert s["entries"] == len({tuple(p[:i + B]) for p in prompts for i in range(0, len(p) - B + 1, B)})
        assert s["cached_tokens"] == B * s["entries"] and s["lookups"] == len(prompts)
        assert s["reused_tokens"] == sum(_expected_cached(p, prompts[:i]) for i, p in enumerate(prompts))
        assert s["collisions"] == 0 and s["evicted"] == 0


def test_sampled_tokens_equal_an_uncached_run(mini_decoder):
    _, dst = mini_decoder(**ROTARY)
    p = _ids(0, 80)
    with KVPool(page_tokens=B) as pool, PrefixCache(pool) as pc:
        _gen(dst, p, pc)
        kw = dict(temperature=0.9, top_k=20, seed=7)
        got = _gen(dst, p[:70] + [1, 2, 3], pc, **kw)
        assert got.cached_tokens == 64
        assert got.token_ids == _gen(dst, p[:70] + [1, 2, 3], **kw).token_ids


@pytest.mark.parametrize("length,cached", [(3 * B, 3 * B - 1), (3 * B + 1, 3 * B), (3 * B - 1, 2 * B)])
def test_block_boundary_at_and_one_off_the_prompt_end(mini_decoder, length, cached):
    """A prompt of 3 blocks (all cached: all but its last token reused), 3 blocks + 1, 3 blocks - 1."""
    _, dst = mini_decoder(**ROTARY)
    base = _ids(9, 4 * B)
    with KVPool(page_tokens=B) as pool, PrefixCache(pool) as pc:
        _gen(dst, base, pc, n=2)
        p = base[:length]
        got = _gen(dst, p, pc)
        assert got.cached_tokens == cached and got.prompt_lengths == [length]
        assert got.token_ids == _gen(dst, p).token_ids


def _stepper(dst):
    sess = InferenceSession(dst, H.so())
    return sess, CacheStepper(sess, read_metadata(dst)), read_metadata(dst)


@pytest.mark.parametrize("page,block,length,copies", [(B, B, 3 * B + 5, False), (B, B, 3 * B, True),
                                                      (2 * B, B, 3 * B + 5, True)])
def test_match_insert_logits_and_copy_on_write(mini_decoder, page, block, length, copies):
    """The API under generate: logits after a matched prefix equal a one-run prefill's; a block of whole pages
    is reused without a copy; a prompt wholly cached (its last token rewritten into a shared page) or a block
    ending inside a page copies that page for the request (never the entry's)."""
    _, dst = mini_decoder(**ROTARY)
    sess, st, meta = _stepper(dst)
    ids = _ids(3, length)
    with KVCache.for_model(sess, 1, 512) as ref:
        want = st.prefill(ref, np.array([ids]))
    with KVPool(page_tokens=page) as pool, PrefixCache(pool, block_tokens=block) as pc:
        first = pc.match(dst, ids[:3 * B], meta=meta)
        with first.cache as c:
            assert first.cached_tokens == 0 and c.seq_lens.tolist() == [0]
            st.prefill(c, np.array([ids[:3 * B]]))
            assert pc.insert(dst, ids[:3 * B], c, meta=meta) == 3
        m = pc.match(dst, ids, meta=meta)
        with m.cache as c:
            assert m.cached_tokens == min(3 * B, length - 1) and c.seq_lens.tolist() == [m.cached_tokens]
            got = st.prefill(c, np.array([ids[m.cached_tokens:]]))
            np.testing.assert_allclose(got, want, atol=ATOL)
            assert (c.stats()["bytes_copied"] > 0) == copies
        assert pc.stats()["hits"] == 3


def test_release_of_entries_never_changes_a_live_request(mini_decoder):
    """A request keeps running on the same K/V when every entry it forked is released under it."""
    _, dst = mini_decoder(**ROTARY)
    sess, st, meta = _stepper(dst)
    ids = _ids(4, 100)
    with KVPool(page_tokens=B) as pool, PrefixCache(pool) as pc:
        with pc.match(dst, ids, meta=meta).cache as c:
            st.prefill(c, np.array([ids]))
            pc.insert(dst, ids, c, meta=meta)
        m = pc.match(dst, ids + [5, 6], meta=meta)
        assert m.cached_tokens == 96
        with m.cache as c, KVCache.for_model(sess, 1, 512, pool=pool) as ref:
            want = st.prefill(ref, np.array([ids + [5, 6]]))
            pc.clear()
            assert pc.stats()["bytes"] == 0 and len(pc) == 0
            np.testing.assert_allclose(st.prefill(c, np.array([[*ids[96:], 5, 6]])), want, atol=ATOL)
            for t in (7, 8, 9):
                np.testing.assert_allclose(st.run(c, np.array([[t]])), st.run(ref, np.array([[t]])), atol=ATOL)

    class ClearingCache(PrefixCache):  # once armed, releases every entry right after generate inserts
        armed = False

        def insert(self, *a, **kw):
            n = super().insert(*a, **kw)
            if self.armed:
                self.clear()
            return n

    with KVPool(page_tokens=B) as pool, ClearingCache(pool) as pc:
        _gen(dst, ids, pc, n=2)
        pc.armed = True
        got = _gen(dst, ids + [1, 2], pc)  # forks 3 blocks, which are all released before its decode steps
        assert got.cached_tokens == 96 and len(pc) == 0 and pool.stats()["live_bytes"] == 0
        assert got.token_ids == _gen(dst, ids + [1, 2]).token_ids


def _entry_bytes(dst):
    """Bytes of one block's entry: pages of every (layer, kv head)."""
    meta = read_metadata(dst)
    return meta["num_layers"] * meta["kv_num_heads"] * B * (meta["head_dim"] + meta["v_head_dim"]) * 4


def test_eviction_least_recently_used_leaves_first_under_max_bytes(mini_decoder):
    _, dst = mini_decoder(**ROTARY)
    one = _entry_bytes(dst)
    a, b = _ids(10, 3 * B + 3), _ids(11, 2 * B + 3)
    with KVPool(page_tokens=B) as pool, PrefixCache(pool, max_bytes=4 * one) as pc:
        _gen(dst, a, pc, n=2)
        assert pc.stats()["entries"] == 3 and pc.stats()["bytes"] == 3 * one
        _gen(dst, b, pc, n=2)   # 5 blocks > 4: a's last block (the oldest leaf) goes
        s = pc.stats()
        assert (s["entries"], s["bytes"], s["evicted"]) == (4, 4 * one, 1)
        got = _gen(dst, a, pc)  # reuses a's 2 blocks, re-inserts the 3rd: now b's last block is the oldest leaf
        assert got.cached_tokens == 2 * B and got.token_ids == _gen(dst, a).token_ids
        assert pc.stats()["evicted"] == 2
        assert _gen(dst, b, pc, n=2).cached_tokens == B   # b's 2nd block back in: a's 3rd (oldest leaf) goes
        assert _gen(dst, a, pc, n=2).cached_tokens == 2 * B
        assert pc.stats()["evicted"] == 4 and pc.stats()["bytes"] == 4 * one
        for e in pc._entries.values():   # every parent of a kept entry is kept
            assert e.length == B or e.parent in pc._entries
    with KVPool(page_tokens=B) as pool, PrefixCache(pool, max_bytes=one // 2) as pc:
        got = _gen(dst, a, pc)   # a budget below one block keeps nothing, and the request still runs
        assert pc.stats()["entries"] == 0 and pc.stats()["evicted"] == 3
        assert got.token_ids == _gen(dst, a).token_ids


def test_pool_budget_releases_entries_for_a_new_request(mini_decoder):
    """With the pool's memory_limit_bytes, entries of earlier prompts go when a request needs their pages."""
    _, dst = mini_decoder(**ROTARY)
    one = _entry_bytes(dst)
    with KVPool(page_tokens=B, memory_limit_bytes=6 * one) as pool, PrefixCache(pool) as pc:
        a, b = _ids(12, 4 * B + 1), _ids(13, 4 * B + 1)
        _gen(dst, a, pc, n=2)
        assert pc.stats()["entries"] == 4 and pool.stats()["live_bytes"] == 4 * one
        got = _gen(dst, b, pc, n=20)  # needs 5 blocks of pages (+ 20 tokens): only 2 are free
        assert got.cached_tokens == 0 and got.token_ids == _gen(dst, b, n=20).token_ids
        assert pc.stats()["evicted"] >= 3 and pool.stats()["live_bytes"] <= 6 * one


def test_pool_goes_back_down_on_clear_and_close(mini_decoder):
    _, dst = mini_decoder(**ROTARY)
    pool = KVPool(page_tokens=B)
    pc = PrefixCache(pool)
    for seed in (20, 21):
        _gen(dst, _ids(0, 70) + _ids(seed, 40), pc, n=3)
    s, p = pc.stats(), pool.stats()
    assert s["entries"] == 4 and p["num_caches"] == 4  # 2 shared blocks + 1 per prompt, nothing else alive
    assert s["bytes"] == s["exclusive_bytes"] == p["live_bytes"] == 4 * _entry_bytes(dst)
    pc.clear()
    assert pool.stats()["live_bytes"] == 0 and pool.stats()["num_caches"] == 0
    _gen(dst, _ids(0, 70), pc, n=3)
    assert pool.stats()["live_bytes"] > 0
    with pytest.raises(ValueError, match=r"in use by 2 cache\(s\)"):
        pool.close()   # entries still use it
    pc.close()
    assert pool.stats()["live_bytes"] == 0
    with pytest.raises(ValueError, match="PrefixCache.match: the PrefixCache is closed"):
        _gen(dst, _ids(0, 70), pc)
    pool.close()


def test_two_models_and_a_rewritten_file_never_share_entries(mini_decoder, tmp_path):
    """Same geometry, other weights: a key includes the model file, so nothing is reused across them."""
    _, m1 = mini_decoder(name="a", **ROTARY)
    _, m2 = mini_decoder(name="b", seed=1, **ROTARY)
    p = _ids(14, 80)
    with KVPool(page_tokens=B) as pool, PrefixCache(pool) as pc:
        _gen(m1, p, pc)
        got = _gen(m2, p, pc)
        assert got.cached_tokens == 0 and got.token_ids == _gen(m2, p).token_ids
        assert _gen(m1, p, pc).cached_tokens == 64
        with open(m2, "rb") as f:
            data = f.read()
        os.replace(m1, str(tmp_path / "old.onnx"))
        with open(m1, "wb") as f:   # m1 now holds m2's weights: its entries must not be used
            f.write(data)
        os.utime(m1, ns=(1, 1))
        got = _gen(m1, p, pc)
        assert got.cached_tokens == 0 and got.token_ids == _gen(m2, p).token_ids


def test_cache_options_are_keyed_or_refused(mini_decoder):
    _, dst = mini_decoder(**ROTARY)
    p = _ids(15, 80)
    with KVPool(page_tokens=B) as pool, PrefixCache(pool) as pc, KVPool() as other:
        _gen(dst, p, pc)
        assert _gen(dst, p, pc, cache_options={"memory_limit_bytes": 1 << 24}).cached_tokens == 0  # other key
        assert _gen(dst, p, pc, cache_options={"page_tokens": 64}).cached_tokens == 0
        assert _gen(dst, p, pc, cache_options={"pool": pool}).cached_tokens == 64  # its own pool: same key
        with pytest.raises(ValueError, match=r"cache_options\['kv_quant'\]; expected None"):
            _gen(dst, p, pc, cache_options={"kv_quant": "int8"})
        with pytest.raises(ValueError, match=r"cache_options\['pool'\]; expected the PrefixCache's pool"):
            _gen(dst, p, pc, cache_options={"pool": other})
        with pytest.raises(ValueError, match=r"cache_options\['sliding_window'\]; expected None"):
            _gen(dst, p, pc, cache_options={"sliding_window": 16})
        with pytest.raises(ValueError, match=r"prefix_cache; expected one prompt \(batch 1"):
            generate(dst, prompt_ids=[p, p], max_new_tokens=2, prefix_cache=pc)
        with pytest.raises(ValueError, match="prefix_cache; expected a PrefixCache or None, got KVPool"):
            generate(dst, prompt_ids=[p], max_new_tokens=2, prefix_cache=pool)
        assert pc.stats()["lookups"] == 4


def test_sliding_window_model_is_refused_unless_every_position_is_kept(mini_decoder):
    _, dst = mini_decoder(window=24, **ROTARY)
    p = _ids(16, 70)
    with KVPool(page_tokens=B) as pool, PrefixCache(pool) as pc:
        with pytest.raises(ValueError, match=r"sliding-window layers \(local_window_size 24\).*'sliding_window': "
                                             r"None"):
            _gen(dst, p, pc)
        opts = {"sliding_window": None}
        _gen(dst, p, pc, cache_options=opts)
        got = _gen(dst, p + [3], pc, cache_options=opts)
        assert got.cached_tokens == 64 and got.token_ids == _gen(dst, p + [3]).token_ids


def test_a_hash_collision_is_a_miss(mini_decoder):
    """With a key that ignores the tokens, every first block collides: the stored ids refuse the match."""
    _, dst = mini_decoder(**ROTARY)

    class Weak(PrefixCache):
        @staticmethod
        def _block_key(parent, tokens):
            return parent + b"x"

    a, b = _ids(17, 70), _ids(18, 70)
    with KVPool(page_tokens=B) as pool, Weak(pool) as pc:
        _gen(dst, a, pc)
        got = _gen(dst, b, pc)
        assert got.cached_tokens == 0 and got.token_ids == _gen(dst, b).token_ids
        assert pc.stats()["collisions"] == 2   # at the lookup and at the insertion; b's blocks stay out
        assert pc.stats()["entries"] == 2 and _gen(dst, a, pc).cached_tokens == 64


def test_bad_arguments(mini_decoder):
    _, dst = mini_decoder(**ROTARY)
    with KVPool(page_tokens=B) as pool:
        for bad in (0, 48, 16, 1 << 17, 1.5):
            with pytest.raises(ValueError, match="PrefixCache: block_tokens"):
                PrefixCache(pool, block_tokens=bad)
        with pytest.raises(ValueError, match="PrefixCache: max_bytes; expected an int >= 1"):
            PrefixCache(pool, max_bytes=0)
        with pytest.raises(ValueError, match="PrefixCache: pool; expected a KVPool, got str"):
            PrefixCache("pool")
        with PrefixCache(pool) as pc:
            with pytest.raises(ValueError, match=r"PrefixCache.match: prompt_ids; expected at least one token"):
                pc.match(dst, [])
            m = pc.match(dst, [1, 2, 3])
            with m.cache as c:
                with pytest.raises(ValueError, match=r"expected at least len\(prompt_ids\) = 3 positions, got 0"):
                    pc.insert(dst, [1, 2, 3], c)
            with KVCache.for_model(dst, 1, 64) as private:
                with pytest.raises(ValueError, match="expected a cache in the PrefixCache's pool"):
                    pc.insert(dst, [1], private)


def test_prefill_progress_on_long_prompts(mini_decoder, monkeypatch, capsys):
    """The prefill after the cached prefix runs in chunks and reports them (tqdm bar or stderr lines)."""
    from onnx_light_ep.generate import _prefix_loop

    _, dst = mini_decoder(**ROTARY)
    monkeypatch.setattr(_prefix_loop, "PREFILL_CHUNK_TOKENS", 40)   # rounded up to 2 blocks: 64
    p = _ids(19, 150)
    with KVPool(page_tokens=B) as pool, PrefixCache(pool) as pc:
        got = _gen(dst, p, pc, progress=True)
        assert "prefill" in capsys.readouterr().err
        assert got.token_ids == _gen(dst, p).token_ids
        _gen(dst, p[:100] + [4], pc, progress=True)   # 5 tokens left: one run, no prefill bar
        assert "prefill" not in capsys.readouterr().err


def test_catalogue_system_prompt_reaches_the_length_within_one_line():
    from onnx_light_ep.bench.prompts import catalogue_questions, catalogue_system_prompt

    class Words:  # a tokenizer of whitespace-separated words
        @staticmethod
        def encode(text):
            return text.split()

    text = catalogue_system_prompt(Words, 300)
    n, last = len(text.split()), text.rstrip("\n").rsplit("\n", 1)[-1]
    assert 300 <= n < 300 + len(last.split()) and text.endswith(".\n")
    assert catalogue_system_prompt(Words, 300) == text and catalogue_system_prompt(Words, 300, seed=1) != text
    qs = catalogue_questions(6)
    assert len(set(qs)) == 6
    with pytest.raises(ValueError, match="num_tokens; expected >= 1"):
        catalogue_system_prompt(Words, 0)
