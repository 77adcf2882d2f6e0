"""MTP layer vs transformers' MtpModel, and speculative decoding (MTP / n-gram drafts): the exactness contract."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm_jax
from glm_jax import model as M
from glm_jax.runtime import speculative as S

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
NAMES = ["glm4moe_full", "glm4moe_plain"]     # glm4moe_fused has glm4moe_full's weights (a loader fixture)
NEW = 40


def _load(name, **kw):
    return glm_jax.Engine.load(os.path.join(GOLDEN, name), dtype="float32", **kw)


def _exp(name):
    return dict(np.load(os.path.join(GOLDEN, name, "expected.npz")))


def _gen(eng, prompt, opts=None, **kw):
    """Generate with some speculative options overridden for this call (they are read per generate call, so one
    engine -- one set of compiled functions -- serves every variant; keeps this file fast on 2 cores)."""
    saved = dict(eng.opts)
    eng.opts.update(opts or {})
    try:
        return eng.generate(prompt, max_new_tokens=kw.pop("n", NEW), stop_on_eos=False, **kw)
    finally:
        eng.opts.clear()
        eng.opts.update(saved)


PLAIN = dict(draft=0)
MTP0 = dict(mtp=True, mtp_guard_pct=0.0)   # MTP drafts all along (random-weight heads would trip the guard)


_ENGINES = {}
_MTP = {}


def _mtp(cfg, params, cache, tokens, hidden, start, own_head=False):
    """M.mtp_forward jitted, one program per shape (as the engine runs it).  Op by op it compiled every primitive
    at every new shape: most of this file's time on 2 cores."""
    key = (id(cfg), own_head)
    if key not in _MTP:
        _MTP[key] = (cfg, jax.jit(lambda p, c, t, h, s: M.mtp_forward(cfg, p, c, t, h, s, own_head=own_head)))
    return _MTP[key][1](params, cache, tokens, hidden, start)


def _engine(name):
    if name not in _ENGINES:
        _ENGINES[name] = _load(name)
    return _ENGINES[name]


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    name = request.param
    exp = _exp(name)
    eng = _engine(name)
    ref = _gen(eng, exp["greedy_prompt"].tolist(), PLAIN)
    return name, exp, eng, ref


# ----------------------------------------------------------------------------- the MTP layer itself
def test_mtp_forward_matches_transformers(case):
    name, exp, eng, _ = case
    cfg, params = eng.cfg, eng.params
    assert params["mtp"] is not None
    cache = M.init_cache(cfg, 1, 32, jnp.float32, with_mtp=True)
    rng = np.random.default_rng(0)                 # the main layers' caches hold numbers the MTP layer must keep
    cache = [{k: jnp.asarray(rng.standard_normal(v.shape), v.dtype) for k, v in d.items()} for d in cache[:-1]] + \
        cache[-1:]
    # transformers puts the pair (x_{t+1}, h_t) at position t+1; we use slot t (vLLM): same relative positions
    start = jnp.asarray([int(exp["mtp_position_ids"][0]) - 1], jnp.int32)
    lg, hn, cache2, _ = _mtp(cfg, params, cache, jnp.asarray(exp["mtp_input_ids"])[None],
                             jnp.asarray(exp["mtp_hidden_in"])[None], start)
    assert np.abs(np.asarray(lg[0]) - exp["mtp_logits"]).max() < 1e-4, name
    assert np.abs(np.asarray(hn[0]) - exp["mtp_hidden_out"]).max() < 1e-4, name
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(cache[:-1], cache2[:-1]) for k in a)   # main: untouched
    assert not np.array_equal(cache[-1]["k"], cache2[-1]["k"])           # the MTP layer's own: written
    if params["mtp"]["head"] is not None:                                # glm4moe_full: checkpoint copies of main
        lg2, _, _, _ = _mtp(cfg, params, cache, jnp.asarray(exp["mtp_input_ids"])[None],
                            jnp.asarray(exp["mtp_hidden_in"])[None], start, own_head=True)
        assert np.abs(np.asarray(lg2[0]) - exp["mtp_logits"]).max() < 1e-4


def test_mtp_layer_one_position_at_a_time_equals_window(case):
    """The MTP KV cache: feeding pairs one by one gives the same as one window (the chained-draft path)."""
    name, exp, eng, _ = case
    cfg, params = eng.cfg, eng.params
    ids, hid = jnp.asarray(exp["mtp_input_ids"])[None], jnp.asarray(exp["mtp_hidden_in"])[None]
    cache = M.init_cache(cfg, 1, 32, jnp.float32, with_mtp=True)
    rows = []
    for t in range(6):
        lg, _, cache, _ = _mtp(cfg, params, cache, ids[:, t:t + 1], hid[:, t:t + 1], jnp.asarray([t], jnp.int32))
        rows.append(np.asarray(lg[0, 0]))
    assert np.abs(np.stack(rows) - exp["mtp_logits"][:6]).max() < 1e-4


# ----------------------------------------------------------------------------- batch invariance
def test_decode_and_verify_rows_are_bitwise_equal(case):
    """Every decode / verify forward runs at one padded width, so a position's logits do not depend on how many
    positions share the forward (XLA:CPU T=1 vs T=4 kernels differ by ~1e-5 otherwise)."""
    from padded_rows import padded_forward, rows_logits

    name, exp, eng, _ = case
    ids = (exp["greedy_prompt"].tolist() + exp["greedy_tokens"].tolist())[:14]
    P = 6
    fwd = padded_forward(eng)
    fwd(ids[:P], 0)
    one = rows_logits(fwd, ids, 1, P)
    for n in (2, 3, 4):
        many = rows_logits(fwd, ids, n, P)
        assert np.array_equal(one, many), (name, n, np.abs(one - many).max())


# ----------------------------------------------------------------------------- the contract: greedy is unchanged
def test_greedy_with_mtp_equals_greedy_without(case):
    name, exp, base, ref = case
    prompt = exp["greedy_prompt"].tolist()
    assert ref.tokens[:32] == exp["greedy_tokens"].tolist()
    variants = ((dict(mtp=True), MTP0, dict(mtp=True, draft=2, mtp_guard_pct=0.0)) if name == "glm4moe_full"
                else (MTP0,))
    for kw in variants:
        r = _gen(base, prompt, kw)
        assert r.tokens == ref.tokens, (name, kw)
        s = r.stats
        assert s["draft_source"] == "mtp" and s["drafts_proposed"] > 0
        assert 0.0 <= s["mtp_acceptance"] <= 1.0
        assert s["forwards"] + 1 + s["drafts_accepted"] == len(r.tokens)
        if "mtp_guard_pct" in kw:
            assert s["guard_pauses"] == 0


def test_greedy_with_ngram_drafts_equals_greedy_without(case):
    name, exp, base, ref = case
    r = _gen(base, exp["greedy_prompt"].tolist(), dict(draft_source="ngram", draft=3))
    assert r.tokens == ref.tokens
    assert r.stats["draft_source"] == "ngram"


def test_mtp_drafts_equal_uncached_mtp(case):
    """The refilled MTP cache: every first draft d_1 equals the argmax of the MTP layer run from scratch over the
    committed sequence with full-forward hidden states (and d_2 = one chained step from there)."""
    name, exp, base, ref = case
    prompt = exp["greedy_prompt"].tolist()
    eng = base
    r = _gen(eng, prompt, MTP0, n=24)
    seq = prompt + r.tokens
    _, hidden = _full_hidden(base, seq)
    cfg, params = base.cfg, base.params
    n = len(seq) - 1
    cache = M.init_cache(cfg, 1, 64, jnp.float32, with_mtp=True)
    lg, hn, cache, _ = _mtp(cfg, params, cache, jnp.asarray(seq[1:])[None], hidden[None, :n],
                            jnp.asarray([0], jnp.int32))
    d1 = np.asarray(lg[0]).argmax(-1)          # d1[t]: draft for position t+2 from the pair at slot t
    checked = 0
    for pos, drafts, m in eng.last_spec_trace:
        if drafts:
            assert drafts[0] == d1[pos - 1], (name, pos)
            checked += 1
    assert checked >= 5
    # one chained step after the first verify
    pos, drafts, _ = eng.last_spec_trace[0]
    c = M.init_cache(cfg, 1, 64, jnp.float32, with_mtp=True)
    _, g, c, _ = _mtp(cfg, params, c, jnp.asarray(seq[1:pos + 1])[None], hidden[None, :pos],
                      jnp.asarray([0], jnp.int32))
    lg2, _, _, _ = _mtp(cfg, params, c, jnp.asarray([[drafts[0]]]), g[:, -1:], jnp.asarray([pos], jnp.int32))
    assert int(np.asarray(lg2[0, 0]).argmax()) == drafts[1]


def _full_hidden(eng, seq):
    from glm_jax.engine import _bucket

    T = _bucket(len(seq))
    eng._ensure_cache(1, T)
    t = np.zeros((1, T), np.int32)
    t[0, :len(seq)] = seq
    lg, h = eng.forward(t, np.zeros(1, np.int32), np.array([len(seq)], np.int32))
    return np.asarray(lg[0, :len(seq)]), jnp.asarray(h[0, :len(seq)])


def test_perfect_drafts_are_all_accepted(monkeypatch):
    """Drafts equal to the true continuation: all accepted, K+1 tokens per forward, same output."""
    name = "glm4moe_full"
    exp = _exp(name)
    prompt = exp["greedy_prompt"].tolist()
    eng = _engine(name)
    ref = _gen(eng, prompt, PLAIN, n=33).tokens
    truth = prompt + ref

    def oracle(seq, k, **_):
        return truth[len(seq):len(seq) + k]

    monkeypatch.setattr(S, "ngram_drafts", oracle)
    r = _gen(eng, prompt, dict(draft_source="ngram", draft=3), n=33)
    assert r.tokens == ref
    assert r.stats["mtp_acceptance"] == 1.0 and r.stats["forwards"] == 8 and r.stats["tokens_per_forward"] == 4.0


# ----------------------------------------------------------------------------- lossy routing under speculation
@pytest.mark.parametrize("residency", ["none", "pinned"])
def test_budget_position_scope_keeps_the_contract(residency):
    name = "glm4moe_full"
    prompt = _exp(name)["greedy_prompt"].tolist()
    kw = dict(expert_budget=1, budget_scope="position", budget_residency=residency, budget_max_positions=0)
    eng = _load(name, **kw)
    a = _gen(eng, prompt, PLAIN, n=40)
    b = _gen(eng, prompt, MTP0, n=40)
    assert a.stats["experts_dropped"] > 0              # the budget is really active
    assert b.tokens == a.tokens


def test_budget_union_scope_is_lossy_but_reports_acceptance():
    """Union scope caps the experts of a whole verify batch, so a verify routes differently from single decodes:
    speculation changes the output (documented as lossy).  It must still run and report acceptance."""
    name = "glm4moe_full"
    prompt = _exp(name)["greedy_prompt"].tolist()
    kw = dict(expert_budget=1, budget_scope="union", budget_residency="none", budget_max_positions=0)
    r = _gen(_load(name, **kw), prompt, MTP0, n=16)
    assert len(r.tokens) == 16 and 0.0 <= r.stats["mtp_acceptance"] <= 1.0


# ----------------------------------------------------------------------------- sampling stays exact
@pytest.mark.parametrize("k,temp,top_k,top_p", [(1, 1.0, 0, 1.0), (2, 0.7, 4, 1.0), (2, 1.3, 0, 0.8)])
def test_rejection_sampling_returns_the_target_distribution(k, temp, top_k, top_p):
    """Draft d_1 ~ q, accept/reject against p: the first emitted token is distributed exactly as p (the FILTERED
    target).  Exact enumeration over d_1 of the accept probabilities, plus a Monte Carlo run of _accept itself."""
    from glm_jax.runtime.sampling import filtered_probs

    V = 6
    rng = np.random.default_rng(k)
    z = jnp.asarray(rng.normal(size=(k + 1, V)) * 1.5, jnp.float32)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(k, V)), jnp.float32), -1)
    p = np.asarray(filtered_probs(z, temp, top_k, top_p))
    qn = np.asarray(q)
    # exact: P(first = x) = q(x) min(1, p/q) + P(reject) * norm(max(0, p - q))(x)
    acc = qn[0] * np.minimum(1.0, p[0] / qn[0])
    resid = np.maximum(p[0] - qn[0], 0.0)
    exact = acc + (1.0 - acc.sum()) * resid / resid.sum()
    assert np.abs(exact - p[0]).max() < 1e-6

    N = 40000
    keys = jax.random.split(jax.random.PRNGKey(7), N)

    def one(key):
        kd, ka = jax.random.split(key)
        d = jax.random.categorical(kd, jnp.log(q), axis=-1).astype(jnp.int32)
        m, nxt = S._accept(z, d, q, jnp.asarray(k, jnp.int32), ka, temperature=temp, top_k=top_k, top_p=top_p, k=k)
        return jnp.where(m >= 1, d[0], nxt)

    first = np.asarray(jax.vmap(one)(keys))
    emp = np.bincount(first, minlength=V) / N
    assert np.abs(emp - p[0]).max() < 0.015, (emp, p[0])
    assert emp[p[0] == 0].sum() == 0                   # filtered-out tokens never appear


def test_deterministic_drafts_sampling_distribution():
    """n-gram drafts (q one-hot): accept d w.p. p(d), else sample p with d removed -> p exactly."""
    from glm_jax.runtime.sampling import filtered_probs

    V = 5
    z = jnp.asarray([[1.0, 0.5, 0.0, -0.5, 2.0], [0.0] * 5], jnp.float32)
    p = np.asarray(filtered_probs(z, 1.0, 0, 1.0))[0]
    N = 40000
    keys = jax.random.split(jax.random.PRNGKey(1), N)
    d = jnp.asarray([1], jnp.int32)
    m, nxt = jax.vmap(lambda kk: S._accept(z, d, None, jnp.asarray(1, jnp.int32), kk, temperature=1.0, top_k=0,
                                           top_p=1.0, k=1))(keys)
    first = np.where(np.asarray(m) >= 1, 1, np.asarray(nxt))
    assert np.abs(np.bincount(first, minlength=V) / N - p).max() < 0.015


def test_sampling_with_mtp_is_seeded_and_top_k1_is_greedy():
    name = "glm4moe_full"
    prompt = [7, 8, 9, 10]
    eng = _engine(name)
    a = _gen(eng, prompt, MTP0, n=16, temperature=0.9, top_k=5, top_p=0.9, seed=3)
    b = _gen(eng, prompt, MTP0, n=16, temperature=0.9, top_k=5, top_p=0.9, seed=3)
    assert a.tokens == b.tokens and a.stats["drafts_proposed"] > 0
    g = _gen(eng, prompt, PLAIN, n=16)
    k1 = _gen(eng, prompt, MTP0, n=16, temperature=1.3, top_k=1, seed=5)
    assert k1.tokens == g.tokens


# ----------------------------------------------------------------------------- guard, n-gram, plan selection
def test_guard_pauses_and_rearms():
    name = "glm4moe_full"
    prompt = _exp(name)["greedy_prompt"].tolist()
    eng = _engine(name)
    r = _gen(eng, prompt, dict(mtp=True, mtp_guard_pct=70.0, mtp_guard_window=6), n=NEW)
    s = r.stats
    # random MTP weights: acceptance ~0 -> trips after 2 verifies, pauses 64 tokens; never trips with pct 0
    assert s["guard_pauses"] >= 1 and s["mtp_acceptance"] < 0.7
    assert s["verifies"] < 10
    r2 = _gen(eng, prompt, MTP0, n=NEW)
    assert r2.stats["guard_pauses"] == 0 and r2.stats["verifies"] > s["verifies"]
    # re-arm: 2 pauses in a long run
    r3 = _gen(eng, prompt, dict(mtp=True, mtp_guard_pct=70.0, mtp_guard_window=3), n=S.GUARD_REARM + 24)
    assert r3.stats["guard_pauses"] >= 2


def test_ngram_lookup():
    assert S.ngram_drafts([1, 2, 3, 4, 9, 1, 2, 3, 4], 3) == [9, 1, 2]          # 4-gram
    assert S.ngram_drafts([5, 1, 2, 7, 7, 8, 1, 2], 2) == [7, 7]                # 2-gram
    assert S.ngram_drafts([1, 2, 3, 1, 2, 5, 1, 2], 3) == [5, 1, 2]             # most recent occurrence
    assert S.ngram_drafts([1, 2, 3, 4], 3) == []
    assert S.ngram_drafts([1, 1, 1, 1], 5) == [1]                               # bounded by the sequence


def test_plan_selection():
    eng = _engine("glm4moe_full")

    def plan(**o):
        saved = dict(eng.opts)
        eng.opts.update(o)
        try:
            return S.draft_plan(eng)
        finally:
            eng.opts.clear()
            eng.opts.update(saved)

    assert plan() is None                                 # MTP is opt-in (measured slower on CPU; README)
    p = plan(mtp=True)
    assert p.source == "mtp" and p.k == 3
    assert plan(mtp=True, draft=0) is None and plan(mtp=False) is None
    p = plan(mtp=False, draft=2)
    assert p.source == "ngram" and p.k == 2
    assert plan(draft_source="ngram") is None            # auto K is 3 only with the MTP layer
    assert plan(draft_source="ngram", draft=4).k == 4


# ----------------------------------------------------------------------------- GLM-5 layout, streamed store
@pytest.mark.parametrize("name", ["dsa_dense", "dsa_sparse"])
def test_glm5_mtp_layer_matches_transformers(name):
    """glm_moe_dsa's MTP layer (MLA + its own indexer): the oracle's MTP logits (see make_golden_dsa.py)."""
    exp = _exp(name)
    eng = _load(name, draft=0)
    cfg, params = eng.cfg, eng.params
    cache = M.init_cache(cfg, 1, 32, jnp.float32, with_mtp=True)
    start = jnp.asarray([int(exp["mtp_position_ids"][0]) - 1], jnp.int32)
    lg, hn, _, _ = _mtp(cfg, params, cache, jnp.asarray(exp["mtp_input_ids"])[None],
                        jnp.asarray(exp["mtp_hidden_in"])[None], start)
    assert np.abs(np.asarray(lg[0]) - exp["mtp_logits"]).max() < 1e-4
    # this fixture stores g before shared_head.norm (expected.json); hn is after it
    want = M.rms_norm(jnp.asarray(exp["mtp_hidden_out"]), params["mtp"]["head_norm"], cfg.rms_norm_eps)
    assert np.abs(np.asarray(hn[0]) - np.asarray(want)).max() < 1e-4


def test_trained_model_streamed_mtp_keeps_the_contract():
    """The shipped model (an int4 container: experts, MTP experts included, through the store): greedy with MTP
    drafts equals greedy without, and its trained MTP head gets drafts accepted."""
    eng = glm_jax.Engine.load(None, cache_cap=2)
    assert eng.opts["fetch"] == "fused"           # streamed (the default where experts stream)
    plain = _gen(eng, "ROMEO:\n", PLAIN, n=32)
    spec = _gen(eng, "ROMEO:\n", MTP0, n=32)
    assert spec.tokens == plain.tokens
    s = spec.stats
    assert s["drafts_accepted"] > 0 and s["tokens_per_forward"] > 1.0
    assert s["bytes_read"] > 0 and "verify_union_per_layer" in s
