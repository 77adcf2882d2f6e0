"""ExpertStore: correctness of fetched banks, exact counters, caps 1..E, pinning, RAM sizing, aliasing."""

import json
import mmap
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.experts.container import open_container
from glm_jax.experts.convert import convert
from glm_jax.experts.store import CacheIndex, ExpertStore, RamBudgetError, StoreError
from glm_jax.kernels import formats as quant
from glm_jax.model import moe
from glm_jax.model.config import load_config
from tools.fixtures.synth_model import tiny_config, write_hf_checkpoint

E = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    write_hf_checkpoint(str(root / "hf"), tiny_config(), seed=3)
    return root


@pytest.fixture(scope="module")
def cont(model):
    dst = str(model / "c_int4")
    convert(str(model / "hf"), dst, expert_format="int4_g32", group_size=32, progress=False)
    return dst


def _fresh(cont, tmp_path):
    """A private copy of the container dir (usage histories are keyed by the model dir's path)."""
    import shutil
    d = str(tmp_path / "m")
    shutil.copytree(cont, d)
    return d, load_config(d)


def _paged_container(tmp_path, layers: int = 3, experts: int = E, inter: int = 128, seed: int = 1):
    """An int4_g64 container at hidden 1024 whose record sections are whole pages (4096-byte multiples, as at the
    real widths): its slots can be read into directly, released and moved.  Returns (dir, config)."""
    hf, d = str(tmp_path / "hf"), str(tmp_path / "c")
    write_hf_checkpoint(hf, tiny_config(hidden_size=1024, moe_intermediate_size=inter, intermediate_size=256,
                                        num_hidden_layers=layers, n_routed_experts=experts,
                                        num_nextn_predict_layers=0), seed=seed)
    convert(hf, d, expert_format="int4_g64", progress=False)
    return d, load_config(d)


def _reference(c, L, e):
    r = c.load_expert(L, e)
    f = c.layout(L).fmt
    return (quant.dequantize(r["gate_up"], r.get("gate_up_scale"), f),
            quant.dequantize(r["down"], r.get("down_scale"), f))


_take = jax.jit(lambda bank, slots: moe.bank_take(bank, slots, jnp.float32))


def _check(bank, slot_of, ids, c, L):
    ids = list(dict.fromkeys(int(i) for i in ids))
    assert (slot_of[ids] >= 0).all()
    gu, dn = _take(bank, jnp.asarray(slot_of[ids]))
    for k, e in enumerate(ids):
        rgu, rdn = _reference(c, L, e)
        np.testing.assert_array_equal(np.asarray(gu[k]), rgu)
        np.testing.assert_array_equal(np.asarray(dn[k]), rdn)


def test_counters_known_sequence(cont, tmp_path):
    d, cfg = _fresh(cont, tmp_path)
    st = ExpertStore.open(d, cfg, cache_cap=2, io_threads=2, max_working_set=3)
    rl = st.layers[1].layout.record_len
    seq = [[0, 1], [1, 0], [2], [0, 2], [3, 4, 5], [5]]
    # LRU cap 2: [0,1] 2 miss | [1,0] 2 hit | [2] miss, evict 1 | [0,2] 2 hit |
    # [3,4,5] 3 miss, evict 0,2 (early: room 3 -> 0 before loading... ) then trim to 2 | [5] hit
    c = open_container(d, cfg)
    for ids in seq:
        bank, so = st.fetch(1, np.array(ids, np.int32))
        _check(bank, so, ids, c, 1)
        assert st.resident_mask(1).sum() <= 2
    s = st.stats()
    assert s["misses"] == s["expert_loads"] == 6
    assert s["hits"] == s["hits_cache"] == 5 and s["hits_pinned"] == 0
    assert s["bytes_read"] == 6 * rl                    # counted at the read call: whole records
    # evictions: 1 ([2]) + 2 ([3,4,5] needs room 3: evicts 0 and 2 first) + 1 (trim to 2 after) = 4
    assert s["evictions"] == 4
    assert s["loads_per_layer"] == {1: 6}
    assert s["requested"] == 11 and abs(s["hit_rate"] - 5 / 11) < 1e-9
    assert list(np.nonzero(st.resident_mask(1))[0]) == [4, 5]
    st.reset_stats()
    assert st.stats()["bytes_read"] == 0
    st.close()


@pytest.mark.parametrize("cap", list(range(1, E + 1)))
def test_caps_1_to_E(cont, tmp_path, cap):
    d, cfg = _fresh(cont, tmp_path)
    st = ExpertStore.open(d, cfg, cache_cap=cap, io_threads=2, max_working_set=4)
    c = open_container(d, cfg)
    rng = np.random.default_rng(cap)
    sim = {L: CacheIndex(E, cap, max(cap, 4)) for L in (1, 2, 3)}
    misses = 0
    for t in range(12):
        for L in (1, 2, 3):
            ids = rng.choice(E, size=rng.integers(1, 5), replace=False)
            bank, so = st.fetch(L, ids)
            if t % 4 == 0 or cap in (1, E):
                _check(bank, so, ids, c, L)
            assert st.resident_mask(L).sum() <= cap
            misses += len(sim[L].access(list(dict.fromkeys(ids.tolist())))[2])
    s = st.stats()
    assert s["misses"] == misses                         # the store follows its cache index exactly
    assert s["bytes_read"] == sum(st.layers[L].layout.record_len * n for L, n in s["loads_per_layer"].items())
    if cap == E:
        assert s["misses"] <= 3 * E                      # everything loaded at most once
    st.close()


@pytest.mark.parametrize("fmt", ["int4_row", "int8_row", "bf16"])
def test_formats_through_store(model, tmp_path, fmt):
    dst = str(tmp_path / fmt)
    convert(str(model / "hf"), dst, expert_format=fmt, progress=False)
    cfg = load_config(dst)
    st = ExpertStore.open(dst, cfg, cache_cap=1, io_threads=1, max_working_set=3)
    c = open_container(dst, cfg)
    for L in (1, 3):
        for ids in ([0, 7, 3], [3], [1, 2]):
            bank, so = st.fetch(L, np.array(ids))
            _check(bank, so, ids, c, L)
    st.close()


def test_alias_and_no_retransfer(cont, tmp_path):
    d, cfg = _fresh(cont, tmp_path)
    st = ExpertStore.open(d, cfg, cache_cap=4, io_threads=2)
    assert st.aliased                                    # XLA:CPU aliases the page-aligned arena
    lc = st.layers[1]
    for n, a in lc.arrays.items():
        assert getattr(lc.bank, n).unsafe_buffer_pointer() == a.ctypes.data
    bank1, _ = st.fetch(1, np.array([2, 3]))
    bank2, _ = st.fetch(1, np.array([3, 2]))            # hits: nothing read, same buffers
    assert bank2 is bank1 and st.stats()["bytes_read"] == 2 * lc.layout.record_len
    st.close()


def test_non_aliased_path_matches(cont, tmp_path):
    """The non-CPU code path (host staging + donated scatter of missed slots) gives the same banks."""
    d, cfg = _fresh(cont, tmp_path)
    a = ExpertStore.open(d, cfg, cache_cap=2, io_threads=2, max_working_set=3)
    b = ExpertStore.open(d, cfg, cache_cap=2, io_threads=2, max_working_set=3, alias=False)
    assert not b.aliased
    c = open_container(d, cfg)
    for ids in ([0, 1], [2, 3, 4], [4, 0], [7]):
        ba, sa = a.fetch(2, np.array(ids))
        bb, sb = b.fetch(2, np.array(ids))
        np.testing.assert_array_equal(sa, sb)
        _check(bb, sb, ids, c, 2)
    assert a.stats()["bytes_read"] == b.stats()["bytes_read"]
    a.close()
    b.close()


def test_pinning_from_usage(cont, tmp_path):
    d, cfg = _fresh(cont, tmp_path)
    rl = ExpertStore.open(d, cfg, cache_cap=1).layers[1].layout.record_len
    # a first session writes the usage history at close
    st = ExpertStore.open(d, cfg, cache_cap=1, max_working_set=2)
    for _ in range(5):
        st.fetch(1, np.array([6, 5]))
        st.fetch(2, np.array([1]))
    st.fetch(1, np.array([0]))
    st.close()
    # the history lives in the per-user state dir (conftest: a temp XDG_STATE_HOME), never in the model dir
    assert st.usage_path.startswith(os.environ["XDG_STATE_HOME"]) and not st.usage_path.startswith(d)
    u = json.load(open(st.usage_path))
    assert u["layers"]["1"][6] == 5 and u["layers"]["2"][1] == 5
    # pin the hottest within pin_gb = 2.5 records: (1,5), (1,6) or (2,1) -> 2 of the 3 count-5 experts
    st = ExpertStore.open(d, cfg, cache_cap=1, max_working_set=2, pin="auto", pin_gb=2.5 * rl / 1e9)
    pinned = {(L, int(e)) for L in (1, 2, 3) for e in np.nonzero(st.pinned_mask(L))[0]}
    assert len(pinned) == 2 and pinned <= {(1, 5), (1, 6), (2, 1)}
    assert st.stats()["pin_bytes_read"] == 2 * rl
    st.reset_stats()
    c = open_container(d, cfg)
    for ids in ([5, 6], [0, 1], [2, 3], [6, 5]):
        bank, so = st.fetch(1, np.array(ids))
        _check(bank, so, ids, c, 1)
    s = st.stats()
    npin1 = sum(1 for L, e in pinned if L == 1)
    assert s["hits_pinned"] == 2 * npin1
    assert all(st.pinned_mask(1)[e] for (L, e) in pinned if L == 1)   # pins are never evicted
    st.close(save_usage=False)
    with pytest.raises(StoreError, match="not found"):
        ExpertStore.open(d, cfg, pin=str(tmp_path / "nope.json"), pin_gb=1.0)


def test_ram_sizing(cont, tmp_path):
    d, cfg = _fresh(cont, tmp_path)
    probe = ExpertStore.open(d, cfg, cache_cap=1)
    per_cap = probe.sizing["per_cap_bytes"]
    buf = probe.sizing["buffer_bytes"]
    probe.close(save_usage=False)
    gb = (1_000_000 + buf + 3 * per_cap + 10) / 1e9
    st = ExpertStore.open(d, cfg, ram_gb=gb, used_bytes=1_000_000)
    assert st.cache_cap == 3
    st.close(save_usage=False)
    with pytest.raises(RamBudgetError) as ei:
        ExpertStore.open(d, cfg, ram_gb=0.001, used_bytes=1_000_000, kv_bytes=500_000)
    msg = str(ei.value)
    assert "\n" not in msg and "one expert per layer needs" in msg and "--ram_gb >=" in msg


def test_working_set_beyond_cap_and_errors(cont, tmp_path):
    d, cfg = _fresh(cont, tmp_path)
    st = ExpertStore.open(d, cfg, cache_cap=1, max_working_set=E)
    c = open_container(d, cfg)
    bank, so = st.fetch(2, np.arange(E))                # a whole union with cap 1
    _check(bank, so, list(range(E)), c, 2)
    assert st.resident_mask(2).sum() == 1
    with pytest.raises(StoreError, match="layer 0 has no streamed"):
        st.fetch(0, np.array([1]))
    with pytest.raises(StoreError, match="out of range"):
        st.fetch(1, np.array([E]))
    st.close(save_usage=False)
    small = ExpertStore.open(d, cfg, cache_cap=1, max_working_set=2)
    with pytest.raises(StoreError, match="max_working_set"):
        small.fetch(1, np.array([0, 1, 2]))
    small.close(save_usage=False)


def test_limit_rounds_lowers_the_fetch_size_and_what_the_cap_can_give_then_puts_it_back(cont, tmp_path):
    """Engine.memory_guard lowers the working set at run time before refusing a longer K/V cache: the
    store then serves at most that many experts a fetch (call_limit: a larger union is fetched in rounds), counts
    the cap's steps below the new working set as what they free (shrink_room), and limit_rounds(None) restores
    the working set it was opened with."""
    d, cfg = _fresh(cont, tmp_path)
    st = ExpertStore.open(d, cfg, cache_cap=3, max_working_set=4)
    try:
        sz = st.sizing
        per, mx = sz["per_cap_bytes"], sz["max_record_bytes"]
        assert st.call_limit(1) == 4 and sz["working_set"] == 4 and st.round_limit is None
        rel = sz["working_set_released"]
        assert st.shrink_room() == 2 * per - (2 * mx if rel else 0)           # caps 3 -> 1, both below W 4
        st.limit_rounds(2)
        assert st.call_limit(1) == 2 and sz["working_set"] == 2 and st.round_limit == 2
        assert st.shrink_room() == 2 * per - (mx if rel else 0)               # only cap 1 -> 1 below W 2
        assert st.shrink_room(working_set=4) == 2 * per - (2 * mx if rel else 0)
        with pytest.raises(StoreError, match="max_working_set"):               # the slots' room is unchanged,
            st.fetch(1, np.arange(5))                                          # the fetch size is the caller's
        st.limit_rounds(None)
        assert st.call_limit(1) == 4 and sz["working_set"] == 4 and st.round_limit is None
        st.limit_rounds(8)                                                     # never above the opened one
        assert st.round_limit is None and st.call_limit(1) == 4
    finally:
        st.close(save_usage=False)


def test_lfu_policy_and_real_prefetch(cont, tmp_path):
    d, cfg = _fresh(cont, tmp_path)
    st = ExpertStore.open(d, cfg, cache_cap=2, policy="lfu", max_working_set=4)
    c = open_container(d, cfg)
    for _ in range(4):
        st.fetch(1, np.array([0]))
    st.fetch(1, np.array([1, 2]))                       # LRU would evict 0; LFU keeps the frequent 0
    assert st.resident_mask(1)[0]
    before = st.stats()
    assert st.prefetch(1, np.array([3, 0])) == 1          # 0 is cached: one background load
    assert st.resident_mask(1)[3]                         # the plugins see it as resident at once
    bank, so = st.fetch(1, np.array([3, 0]))
    _check(bank, so, [3, 0], c, 1)
    s = st.stats()
    rec = st.layers[1].layout.record_len
    assert s["bytes_read"] - before["bytes_read"] == rec          # counted where it was read, exactly once
    assert s["prefetch_bytes"] == rec and s["prefetch_loads"] == 1 and s["prefetch_hits"] == 1
    assert s["expert_loads"] - before["expert_loads"] == 1
    assert s["misses"] == before["misses"] and s["hits_cache"] - before["hits_cache"] == 1    # 0 only
    # a wrong prediction: loaded, counted, reported unused, and evicted first
    assert st.prefetch(1, np.array([5])) == 1
    bank, so = st.fetch(1, np.array([6]))
    _check(bank, so, [6], c, 1)
    s2 = st.stats()
    assert s2["prefetch_unused"] == 1 and s2["bytes_read"] - s["bytes_read"] == 2 * rec
    assert not st.resident_mask(1)[5]
    st.close(save_usage=False)
    with pytest.raises(StoreError, match="unknown cache policy"):
        ExpertStore.open(d, cfg, cache_cap=1, policy="fifo")


def test_plain_hf_dir_through_store(model):
    d = str(model / "hf")
    cfg = load_config(d)
    st = ExpertStore.open(d, cfg, cache_cap=2, io_threads=2, max_working_set=2)
    assert st.layers[1].layout.fmt == "f32"
    bank, so = st.fetch(1, np.array([4, 6]))
    gu, dn = _take(bank, jnp.asarray(so[[4, 6]]))
    from glm_jax.experts.container import SafeTensorsDir
    sd = SafeTensorsDir(d)
    np.testing.assert_array_equal(np.asarray(dn[1]), sd.read("model.layers.1.mlp.experts.6.down_proj.weight"))
    assert st.stats()["bytes_read"] == 2 * 3 * 64 * 64 * 4
    st.close(save_usage=False)


def test_direct_io_matches_buffered(cont, tmp_path):
    d, cfg = _fresh(cont, tmp_path)
    try:
        st = ExpertStore.open(d, cfg, cache_cap=2, io_threads=2, max_working_set=3, direct_io=True)
    except StoreError as e:   # a file system without O_DIRECT
        pytest.skip(str(e))
    c = open_container(d, cfg)
    for ids in ([0, 5], [5, 6, 7], [1]):
        bank, so = st.fetch(3, np.array(ids))
        _check(bank, so, ids, c, 3)
    assert st.stats()["bytes_read"] == 5 * st.layers[3].layout.record_len   # 5 misses
    st.close(save_usage=False)


@pytest.mark.parametrize("direct", [False, True])
def test_chunked_reads_match_whole_record_reads(cont, tmp_path, direct):
    """--read_chunk_mb splits each record into byte ranges read in parallel: same bytes, same count."""
    d, cfg = _fresh(cont, tmp_path)
    c = open_container(d, cfg)
    rec = c.layout(3).record_len
    try:
        st = ExpertStore.open(d, cfg, cache_cap=2, io_threads=3, max_working_set=3, direct_io=direct,
                              read_chunk_mb=4096 / (1 << 20))
    except StoreError as e:   # a file system without O_DIRECT
        pytest.skip(str(e))
    assert rec > 2 * 4096      # really split
    for ids in ([0, 5], [5, 6, 7], [1]):
        bank, so = st.fetch(3, np.array(ids))
        _check(bank, so, ids, c, 3)
    assert st.stats()["bytes_read"] == 5 * rec
    st.close(save_usage=False)
    with pytest.raises(StoreError, match="read_chunk_mb"):
        ExpertStore.open(d, cfg, cache_cap=1, read_chunk_mb=-1)


def test_balanced_chunk_splits_a_record_evenly_over_the_threads():
    """Each record is read as a multiple of io_threads near-equal ranges of at most read_chunk bytes."""
    from glm_jax.experts.container import balanced_chunk
    MB = 1 << 20
    for length in (3_540_000, 19_000_000, 4096 * 3, 7 * MB):
        for threads in (1, 2, 4, 8):
            for chunk in (4096, MB, 4 * MB):
                c = balanced_chunk(length, threads, chunk)
                n = -(-length // c)
                assert c % 4096 == 0 and c <= max(chunk, 4096)
                assert n % threads == 0 or c == 4096, (length, threads, chunk, c, n)
                assert length - (n - 1) * c >= c - n * 4096      # the last range is as long as the others, +- rounding
    assert balanced_chunk(3_540_000, 4, MB) == 4096 * 217           # 4 ranges of 0.885 MB, not 1+1+1+0.54
    assert balanced_chunk(123, 4, 0) == 0


def test_a_fetch_of_as_many_misses_as_threads_reads_whole_records(cont, tmp_path, monkeypatch):
    """Byte ranges only where a fetch's misses are fewer than the I/O threads (a lone miss is read by every thread);
    with at least as many misses as threads each is one read (1 MB ranges of GLM-5.2's 20 MB records took 1.07-1.17x
    longer there).  Same bytes either way."""
    from glm_jax.experts.store import fetch_chunk
    MB = 1 << 20
    assert fetch_chunk(20 * MB, 4, 4, MB) == 0 and fetch_chunk(20 * MB, 9, 4, MB) == 0
    assert fetch_chunk(20 * MB, 3, 4, MB) == fetch_chunk(20 * MB, 1, 4, MB) == MB
    assert fetch_chunk(20 * MB, 1, 4, 0) == 0
    d, cfg = _fresh(cont, tmp_path)
    c = open_container(d, cfg)
    st = ExpertStore.open(d, cfg, cache_cap=2, io_threads=2, max_working_set=3, read_chunk_mb=4096 / (1 << 20))
    seen = []
    real = st.source.read_jobs
    monkeypatch.setattr(st.source, "read_jobs", lambda L, e, dests, chunk: seen.append(chunk) or real(L, e, dests, chunk))
    for ids, chunked in (([1], True), ([5, 6, 7], False)):
        seen.clear()
        bank, so = st.fetch(3, np.array(ids))
        _check(bank, so, ids, c, 3)
        assert seen and all((ch > 0) == chunked for ch in seen), (ids, seen)
    st.close(save_usage=False)


def test_populate_keeps_slot_contents(cont, tmp_path):
    """The background page populate (MADV_POPULATE_WRITE) may overlap reads into the same slots: it must never
    change what a slot holds."""
    d, cfg = _fresh(cont, tmp_path)
    c = open_container(d, cfg)
    st = ExpertStore.open(d, cfg, cache_cap=3, io_threads=2)
    st._populate.join()
    bank, so = st.fetch(3, np.array([1, 4, 6]))
    lc = st.layers[3]
    assert lc.populate(lc.S) in (True, False)     # False only on kernels < 5.14
    _check(bank, so, [1, 4, 6], c, 3)
    st.close(save_usage=False)
    c.close()


def test_populate_stays_within_the_ram_budget(cont, tmp_path, monkeypatch):
    """An explicit --cache_cap beyond the RAM budget: only the slots the budget holds are faulted in at open."""
    from glm_jax.experts import store as S
    d, cfg = _fresh(cont, tmp_path)
    c = open_container(d, cfg)
    recs = [c.layout(L).record_len for L in c.expert_layers]
    c.close()
    W = cfg.num_experts_per_tok
    ram = (2 * max(recs) + W * max(recs) + 1.5 * sum(recs)) / 1e9      # buffers + 1.5 experts per layer
    seen = []
    monkeypatch.setattr(S._Layer, "populate", lambda self, n: seen.append(n) or True)
    st = ExpertStore.open(d, cfg, cache_cap=6, ram_gb=ram, io_threads=2, max_working_set=W)
    st._populate.join()
    assert st.sizing["cap_that_fits"] == 1 and st.cache_cap == 6
    assert seen == [1] * len(recs)
    st.close(save_usage=False)


def test_stream_bench_counts_what_the_store_read(cont, tmp_path):
    """tools/bench/stream.py on a tiny container: bytes per token are the store's misses x record length, and the
    disk limit was sampled during (every 3rd fetch call) and after the run."""
    from tools.bench.stream import bench
    d, cfg = _fresh(cont, tmp_path)
    c = open_container(d, cfg)
    rec, layers = {L: c.layout(L).record_len for L in c.expert_layers}, len(c.expert_layers)
    c.close()
    r = bench(d, cap=2, tokens=6, io_threads=2, compute=True, limit_reads=8, limit_every=3, limit_burst=4)
    assert sum(r["loads_per_layer"].values()) == r["misses"] > 0
    assert r["bytes_per_token"] * r["tokens"] == sum(n * rec[L] for L, n in r["loads_per_layer"].items())
    assert r["limit_bursts"] == 1 + (6 * layers) // 3
    assert r["limit_gbps"] > 0 and r["ratio"] > 0 and r["tok_s"] > 0


_PEAK_CHILD = r"""
import sys, threading, time
import jax, jax.numpy as jnp
import glm_jax.engine                            # the whole runtime imported before it is measured
from glm_jax import memory
jnp.zeros(8).block_until_ready()
peak = [0]
def poll():          # the budget bounds private memory (RssAnon + RssShmem); the kernel keeps no peak of it
    while True:
        peak[0] = max(peak[0], memory.private_bytes())
        time.sleep(0.002)
threading.Thread(target=poll, daemon=True).start()
budget = (memory.private_bytes() + 300e6) / 1e9   # the runtime as it is here + 300 MB for the model and its cache
eng = glm_jax.Engine.load(sys.argv[1], ram_gb=budget, fetch="loop", max_seq_len=128)
eng.generate(list(range(1, 17)), max_new_tokens=40, stop_on_eos=False)     # random routing: every expert is asked for
eng.generate(list(range(1, 17)), max_new_tokens=40, stop_on_eos=False)     # after the cache grew into the workspace
time.sleep(0.05)
print("RESULT", peak[0], budget * 1e9, eng.store.cache_cap, eng.cfg.n_routed_experts)
"""


def test_the_ram_budget_bounds_the_whole_process(over_budget_container):
    """--ram_gb is the process's budget: the peak private memory (RssAnon + RssShmem, sampled every 2 ms; file-backed
    pages are reclaimable) of a real run stays under it, although the experts (300 MB) do not fit beside the
    runtime, also after the cache grew into the measured-free workspace reserve (second generate).  Before, the
    budget counted only dense + KV + cache: this run cached every expert and peaked ~90 MB above its budget."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _PEAK_CHILD, over_budget_container()], capture_output=True, text=True,
                       timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, r.stderr[-2000:]
    peak, budget, cap, n_exp = (float(v) for v in line[0].split()[1:])
    assert cap < n_exp                     # the cache was sized down to fit beside the runtime
    assert peak <= budget, (peak / 1e6, budget / 1e6)


def test_reads_into_aligned_slots_count_no_staging_buffers(cont, tmp_path, monkeypatch):
    """The memory plan and the store reserved one record-sized staging buffer per I/O thread (4 x 19 MB at GLM-5.2's
    widths, 4 x 9.7 MB at GLM-4.5-Air's), but a read of a layout whose sections are all 4096-byte multiples -- those
    real widths -- scatters straight into the slot arenas, O_DIRECT or not: nothing is staged, so nothing is counted.
    A misaligned layout (this module's tiny int4_g32 experts) still counts them."""
    from glm_jax.experts import container as C

    dst, cfg = _paged_container(tmp_path, layers=2, experts=4)
    c = open_container(dst, cfg)
    assert c.layout(1).direct_into_slots and c.read_buffer_bytes(4) == 0
    staged = []
    real = C._scratch
    monkeypatch.setattr(C, "_scratch", lambda n: staged.append(n) or real(n))
    try:
        st = ExpertStore.open(dst, cfg, cache_cap=2, io_threads=2, max_working_set=3, direct_io=True)
    except StoreError as e:   # a file system without O_DIRECT
        pytest.skip(str(e))
    rec = c.layout(1).record_len
    assert st.sizing["buffer_bytes"] == 3 * rec                  # the transient working set only
    bank, so = st.fetch(1, np.array([0, 3, 2]))
    _check(bank, so, [0, 3, 2], c, 1)
    assert max(staged, default=0) < rec                          # at most the padding between sections
    st.close(save_usage=False)
    small = open_container(cont, load_config(cont))
    assert not small.layout(3).direct_into_slots
    assert small.read_buffer_bytes(4) == 4 * small.layout(3).record_len


def test_a_cache_below_the_working_set_holds_one_layers_transient_slots_at_a_time(cont, tmp_path):
    """The budget counts a cap below the working set as cap x (one record of every layer) + (working set - cap) x
    a record (memory.cache_slots): the fetched layer's kept slots are part of its working set, and the slots
    beyond them are returned to the OS at the next fetch.  The old sizing added the whole working set on top of
    the cap, and refused this budget."""
    d, cfg = _paged_container(tmp_path)                # sections of whole pages: transient slots released
    c = open_container(d, cfg)
    rec = {L: c.layout(L).record_len for L in c.expert_layers}
    from glm_jax.experts.store import working_set_released
    assert working_set_released(c, list(rec)) and len(rec) >= 2
    c.close()
    W, mx, layers = 4, max(rec.values()), sorted(rec)
    probe = ExpertStore.open(d, cfg, cache_cap=1, io_threads=2, max_working_set=W)
    staging = probe.sizing["buffer_bytes"] - W * mx
    probe.close(save_usage=False)
    ram = (1_000_000 + staging + sum(rec.values()) + (W - 1) * mx + 10) / 1e9     # cap 1, exactly
    st = ExpertStore.open(d, cfg, ram_gb=ram, used_bytes=1_000_000, io_threads=2, max_working_set=W,
                          state_dir="off")
    try:
        assert st.cache_cap == 1 and st.sizing["cap_that_fits"] == 1
        rng = np.random.default_rng(0)
        for step in range(6):
            for L in layers:
                ids = rng.choice(E, W, replace=False)
                bank, so = st.fetch(L, ids)
                assert (so[ids] >= 0).all()
                held = {L2: len(st.layers[L2].touched) for L2 in layers}
                # every other layer is back to its one kept slot; the fetched one holds its working set
                assert held[L] <= W and all(held[L2] <= 1 for L2 in layers if L2 != L), (step, L, held)
        assert len(st.layers[layers[-1]].touched) > 1
        st.release_transient()                        # between forwards (the engine's refit measures after it)
        assert all(len(st.layers[L].touched) == 1 for L in layers)
    finally:
        st.close(save_usage=False)
    with pytest.raises(RamBudgetError, match="working set beyond its cached expert"):
        ExpertStore.open(d, cfg, ram_gb=ram - 20e-9, used_bytes=1_000_000, io_threads=2, max_working_set=W)


def test_a_fresh_slot_takes_the_pages_another_layer_gives_back_instead_of_faulting_new_ones(tmp_path):
    """A cache below the working set: each fetch needs fresh slots for its transient experts, and the layer
    fetched before gives as many back.  Releasing them (MADV_DONTNEED) and faulting new ones in for the read cost
    ~2,300 page faults and a zero fill per 9 MB record (the GLM-4.5-Air slice at 0.3x: 865 k faults and 1.8 s of
    system time per 64 tokens); the store moves the given-back pages to the fresh slot instead (mremap), so the
    process faults nothing in for them, holds no more than before, and every bank still holds the right bytes."""
    import resource
    d, cfg = _paged_container(tmp_path, layers=4, inter=512, seed=2)     # sections of whole pages: slots can move
    c = open_container(d, cfg)
    W = 4
    st = ExpertStore.open(d, cfg, cache_cap=1, io_threads=1, max_working_set=W, state_dir="off")
    try:
        layers = sorted(st.layers)
        pages = st.layers[layers[0]].layout.record_len // mmap.PAGESIZE
        rng = np.random.default_rng(0)
        st._populate.join()
        for L in layers:                                # every layer's slots used once: their pages exist
            st.fetch(L, np.arange(W))
        faults, moved0 = 0, st.stats()["pages_moved"]
        for step in range(8):
            for L in layers:
                ids = rng.choice(E, W, replace=False)
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                bank, so = st.fetch(L, ids)
                faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0     # the fetch's own
                _check(bank, so, ids, c, L)
                held = {L2: len(st.layers[L2].touched) for L2 in layers}
                assert held[L] <= W and all(held[L2] <= 1 for L2 in layers if L2 != L), (step, L, held)
        moved = st.stats()["pages_moved"] - moved0
        assert moved >= 8 * len(layers)                 # fresh slots of every fetch came with pages
        assert faults < moved * pages / 4, (faults, moved, pages)     # released + refaulted: ~moved x pages
    finally:
        st.close(save_usage=False)
        c.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_replay_hits_leaves_the_store_as_one_fetch_per_call(cont, tmp_path, policy):
    """The fused program's layers that skipped the host are replayed in one bulk call per layer (replay_hits): the
    store's counters, usage, policy state and its later evictions must be those of one fetch per call."""
    d, cfg = _fresh(cont, tmp_path)
    rng = np.random.default_rng(5)
    calls = [np.unique(rng.choice(4, rng.integers(1, 4), replace=False)) for _ in range(40)]
    stores = [ExpertStore.open(d, cfg, cache_cap=5, policy=policy, max_working_set=4, state_dir="off")
              for _ in range(2)]
    for st in stores:
        st.fetch(1, np.array([0, 1, 2, 3]))                 # every expert the calls use is resident
        st.fetch(1, np.array([4]))
    for u in calls:
        stores[0].fetch(1, u)
    assert stores[1].replay_hits(1, calls)
    a, b = stores[0], stores[1]
    timing = ("fetch_s", "io_wait_s", "read_s", "read_gbps", "pin_load_s")       # seconds: not bookkeeping
    counts = [{k: v for k, v in st.stats().items() if k not in timing} for st in stores]
    assert counts[0] == counts[1] and counts[0]["fetch_calls"] == 42 and counts[0]["hits_cache"] > 40
    np.testing.assert_array_equal(a._usage[1], b._usage[1])
    pa, pb = a.index[1].policy, b.index[1].policy
    assert pa.t == pb.t and np.array_equal(pa.last, pb.last)
    if policy == "lfu":
        assert pa.calls == pb.calls and np.array_equal(pa.at, pb.at) and np.array_equal(pa.score, pb.score)
    for st in stores:                                       # the next misses evict the same experts
        st.fetch(1, np.array([5, 6]))
        st.fetch(1, np.array([7]))
    assert np.array_equal(a.resident_mask(1), b.resident_mask(1))
    # a call with an expert not resident: nothing replayed, nothing changed
    out = int(np.nonzero(~b.resident_mask(1))[0][0])
    before = (b.stats(), b._usage[1].copy(), b.index[1].policy.last.copy())
    assert not b.replay_hits(1, [np.array([0]), np.array([out])])
    assert b.stats()["fetch_calls"] == before[0]["fetch_calls"] and b.stats()["requested"] == before[0]["requested"]
    assert np.array_equal(b._usage[1], before[1])
    assert np.array_equal(b.index[1].policy.last, before[2])
    for st in stores:
        st.close(save_usage=False)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _vma_of(addr: int) -> tuple:
    """(permissions, AnonHugePages kB, VmFlags) of the mapping holding addr, from /proc/self/smaps."""
    perms, huge, flags, inside = None, 0, [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
                if inside:
                    perms = head[1]
            elif inside and line.startswith("AnonHugePages:"):
                huge = int(head[1])
            elif inside and line.startswith("VmFlags:"):
                flags = head[1:]
    return perms, huge, flags


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_slot_arenas_are_private_memory_on_huge_pages():
    """An arena is private anonymous memory (mmap's default MAP_SHARED is shmem: no transparent huge pages, and
    MADV_DONTNEED there unmaps without freeing), advised MADV_HUGEPAGE before its first page is faulted in where it
    will be filled whole; a partly used one stays on 4 KB pages (a first touch would fault in 2 MB around it)."""
    from glm_jax.experts.store import _mmap_array

    a, mm = _mmap_array((3, 4 << 20), np.uint8, huge=True)   # 12 MB: at least 4 whole 2 MB pages inside
    a[:] = 1
    perms, huge, flags = _vma_of(a.ctypes.data)
    assert perms is not None and perms.endswith("p"), perms        # private, not shared ("s")
    if _thp_mode() in ("always", "madvise"):
        assert "hg" in flags and huge >= 4 * 2048, (flags, huge)
    mm.madvise(mmap.MADV_DONTNEED, 0, len(mm))
    assert not a.any()                                 # a private page released reads back as zeros
    b, _ = _mmap_array((3, 4 << 20), np.uint8)
    b[:] = 1
    perms, _, flags = _vma_of(b.ctypes.data)
    assert perms.endswith("p") and "hg" not in flags, (perms, flags)


def test_huge_pages_advises_only_the_whole_pages_inside_the_range():
    from glm_jax import memory as MEM

    M = MEM.HUGE_PAGE
    assert MEM.huge_pages(0x1000, M - 0x2000) == 0
    buf = mmap.mmap(-1, 8 * M, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    lo = (base + M - 1) // M * M
    got = MEM.huge_pages(lo + M // 2, 3 * M)           # [lo + 0.5 M, lo + 3.5 M): whole pages [lo + M, lo + 3 M)
    assert got in (0, 2 * M)                          # 0: a kernel without THP refuses


def test_shrink_cap_takes_no_step_that_frees_nothing(tmp_path):
    """Below the working set, a cap step frees one expert of every layer less the fetched layer's transient slot
    (memory.cache_slots); with one streamed layer that is nothing.  glm-jax-serve on the GLM-5.2 slice (one MoE
    layer, cache 32 = working set 32) was asked for 34 MB and went to one expert a layer: every cached expert
    evicted for no byte, and decode at half speed until the refits grew it back.  shrink_cap stops where
    its steps stop freeing anything."""
    d, cfg = _paged_container(tmp_path, layers=2)      # layer 0 dense: one streamed layer
    st = ExpertStore.open(d, cfg, ram_gb=10.0, used_bytes=0, io_threads=1, max_working_set=4, headroom_bytes=0,
                          state_dir="off")
    try:
        (L,) = st.layers
        assert st.sizing["working_set_released"]
        per = st.sizing["per_cap_bytes"]
        assert per == st.sizing["max_record_bytes"]
        st.index[L].cap = st.cache_cap = 6
        st.fetch(L, np.array([0, 1, 2, 3]))
        st.fetch(L, np.array([4, 5]))
        assert st.shrink_room() == 2 * per              # 6 -> 5 -> 4 free an expert each; below 4, nothing
        assert st.shrink_cap(per) == 5                  # what was asked, as before
        assert st.shrink_cap(10 * per) == 4             # more than the room: down to the working set, no further
        assert st.index[L].cap == 4 and len(st.index[L].cached) == 4
        assert st.shrink_cap(per) == 4                  # nothing left to free: nothing evicted
        assert len(st.index[L].cached) == 4 and st.sizing["shrunk_by"] == 2
    finally:
        st.close(save_usage=False)


def test_shrink_cap_evicts_to_the_lower_cap_and_returns_the_slots_pages(tmp_path):
    """When a run outgrows its memory plan (a KV cache grown past its reservation, programs compiled since), the
    engine takes the room back from the expert cache: each layer's cap goes down by the bytes asked / one expert
    of every layer (rounded up, never below one), the victims leave the cache, their slots' pages go back to the
    OS at once, and an evicted expert is a miss again.  ``grow_cap`` hands it back."""
    d, cfg = _paged_container(tmp_path)                # sections of whole pages: slots can be released
    st = ExpertStore.open(d, cfg, ram_gb=10.0, used_bytes=0, io_threads=1, max_working_set=4, headroom_bytes=0,
                          state_dir="off")
    try:
        layers = sorted(st.layers)
        for L in layers:
            st.index[L].cap = 6
        st.cache_cap = 6
        for L in layers:                               # 6 experts cached per layer, 0..5 in that order (LRU)
            st.fetch(L, np.array([0, 1, 2, 3]))
            st.fetch(L, np.array([4, 5]))
        assert all(len(st.index[L].cached) == 6 for L in layers)
        per = st.sizing["per_cap_bytes"]
        held = {L: len(st.layers[L].touched) for L in layers}
        assert st.shrink_cap(2 * per + 1) == 3          # 2 experts' worth and a byte: 3 fewer a layer
        for L in layers:
            assert st.index[L].cap == 3 and st.index[L].cached == {3, 4, 5}     # the least recently used left
            lc = st.layers[L]
            assert (lc.slot_of[[0, 1, 2]] == -1).all() and (lc.slot_of[[3, 4, 5]] >= 0).all()
            assert len(lc.touched) == held[L] - 3       # their pages returned now, not at a later fetch
        misses = st.stats()["misses"]
        bank, so = st.fetch(layers[0], np.array([0, 3]))
        _check(bank, so, [0, 3], open_container(d, cfg), layers[0])
        assert st.stats()["misses"] == misses + 1
        assert st.shrink_cap(100 * per) == 1            # never below one expert a layer
        assert st.shrink_cap(0) == 1
        assert st.sizing["shrunk_by"] == 3 + 2           # the cap steps taken
        st._populate.join()
        if st._populated[0]:                            # (grow_cap measures nothing on a kernel < 5.14)
            assert st.grow_cap(2 * per) == 3
            assert st.sizing["taken"] == 5 - 2          # what was taken and not given back yet
    finally:
        st.close(save_usage=False)
