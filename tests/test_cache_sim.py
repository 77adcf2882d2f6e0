"""tools/bench/cache_sim.py: the offline optimum (Belady) against the shipped policies on the same traces."""

import pytest

from glm_jax import options as O
from tools.bench import cache_sim


def test_belady_hand_trace():
    # one layer, cap 1: A B A B -> MIN keeps A over B at step 1 (A is needed sooner): 1 hit of 4;
    # LRU with one slot never hits
    trace = [[(0, [0])], [(0, [1])], [(0, [0])], [(0, [1])]]
    assert cache_sim.belady(trace, 1)["hit_rate"] == pytest.approx(0.25)
    assert cache_sim.simulate(trace, "lru", 1, 4, working_set=1)["hit_rate"] == 0.0
    # duplicates within a forward count once; never-reused experts are evicted first
    trace = [[(0, [0, 0, 2])], [(0, [1])], [(0, [0])]]
    assert cache_sim.belady(trace, 1)["hit_rate"] == pytest.approx(1 / 4)


@pytest.mark.parametrize("cap", [2, 8, 24])
def test_belady_bounds_the_shipped_policies(cap):
    trace = cache_sim.synthetic_trace(n_tokens=400, layers=2, E=64, k=8, zipf=1.1, repeat=0.3, seed=1)
    opt = cache_sim.simulate(trace, "belady", cap, 64, warmup=50)["hit_rate"]
    for pol in ("lru", "lfu"):
        h = cache_sim.simulate(trace, pol, cap, 64, working_set=8, warmup=50)["hit_rate"]
        assert h <= opt + 1e-9, (pol, cap, h, opt)
    assert opt > 0


def test_the_engines_default_policy_is_the_one_that_hits_more():
    """--cache_policy defaults to lfu: on skewed routing (and on the shipped model's own trace, the replays
    in docs/benchmarks.md) it hits more often than lru at every cache size.  Before, the default was lru."""
    trace = cache_sim.synthetic_trace(n_tokens=400, layers=2, E=64, k=8, zipf=1.1, repeat=0.3, seed=1)
    for cap in (4, 16, 32):       # (cap 8 = the working set of 8: every policy keeps the last union)
        h = {p: cache_sim.simulate(trace, p, cap, 64, working_set=8, warmup=50)["hit_rate"] for p in ("lru", "lfu")}
        assert h["lfu"] > h["lru"], (cap, h)
    assert O.resolve({})["cache_policy"] == "lfu"


def test_a_union_larger_than_the_working_set_is_replayed_in_the_stores_rounds():
    """A prefill chunk's union within a RAM budget is larger than one fetch holds: the engine fetches it in rounds of
    the working set (_chunked_moe, a segment's rounds), and the replay does the same (before: StoreError, so a trace
    from the GLM-4.5-Air slice's 0.3x box could not be replayed).  Rounds A = 0-3, B = 4-7, C = 8-9 twice, cap 4: LRU
    never hits; Belady keeps A for its second use (4 hits of 20)."""
    trace = [[(0, list(range(10)))], [(0, list(range(10)))]]
    rows = cache_sim.compare(trace, [4], ["lru", "belady"], 16, 4, 0)
    assert rows == [(4, [0.0, pytest.approx(0.2)])]
    assert cache_sim.in_rounds(trace, 4)[0] == [(0, [0, 1, 2, 3]), (0, [4, 5, 6, 7]), (0, [8, 9])]
