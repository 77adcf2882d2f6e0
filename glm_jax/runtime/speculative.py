"""Speculative decoding: MTP (the model's own nextn layer) or prompt-lookup n-gram drafts, verified by the main model.

One iteration (one sequence; state: main cache committed through position p, pending token x_{p+1}, hidden h_p):

1. **Draft** K tokens.  MTP: the MTP layer on the pair (x_{p+1}, h_p) gives d_1; chaining the one layer on
   (d_{k-1}, g_{k-1}) gives d_k (g = the MTP output after shared_head.norm, as transformers/SGLang chain it).
   n-gram: the continuation of the longest earlier occurrence of the last 4..2 tokens in prompt + output.
2. **Verify**: ONE main forward over [x_{p+1}, d_1..d_K] at positions p+1..p+1+K.
3. **Accept**.  Greedy: the longest prefix with d_j == argmax z_{j-1}, plus the correction / bonus token.
   temperature > 0: rejection sampling (accept d_j with prob min(1, p(d_j)/q(d_j)), else resample from
   norm(max(0, p - q)); bonus from p_K) with p, q the FILTERED distributions (``generate.filtered_probs``: the same
   temperature / top-k / top-p), so the output distribution is exactly the non-speculative one.
4. **Roll back**: both caches are static and position-indexed, so rolling back is rewinding the position; stale
   entries past it are masked by causality and overwritten later.  The MTP cache is refilled for the newly committed
   positions with their verified hidden states in the next draft call (the "catch-up" window, which also yields d_1).

MTP positions use vLLM's convention (the pair (x_{t+1}, h_t) in MTP cache slot t; see model.mtp_forward).

**Batch invariance.**  XLA:CPU's kernels give a row different rounding depending on how many rows share the
computation: a one-row matmul takes a vector-dot path (logits differ by ~1e-5 from the same position inside a T=4
verify), and even softmax / reductions change vectorisation with the row count (seen at S >= 256 cache slots).  Any
of that can flip a near-tie argmax.  So every main decode / verify forward of the generation loop runs at ONE padded
width ``decode_width`` (4 = K+1 for the default K=3; extra rows are masked padding, lengths = real rows): the same
compiled program, and each row's result was measured bitwise independent of its index and of the other rows.  The
plain (non-speculative) decode loop in generate.py uses the same width, so greedy with drafts == greedy without,
token for token.  With K+1 > 4 the verify width grows and exactness vs plain decode is up to that rounding noise.
Cost: padding alone made a decode 3.3x slower on a 512-hidden / 32-expert top-8 model (the MoE gathered experts for
the padding rows), so ``Engine.forward`` passes ``moe_rows`` = the real rows of a short forward and the routed
experts run on those rows only (their gather path is row-count invariant; model.layer_forward): padded decode then
costs +22% (51 -> 63 ms/forward on that model, 2-core CPU; noise level on the tiny fixtures).

**The guard** (colibri's COLI_MTP_GUARD_*): after each verify the K proposals' outcomes enter a window of the last
``mtp_guard_window`` proposals; when the window is full and its acceptance is below ``mtp_guard_pct`` %, drafting
pauses for ``GUARD_REARM`` = 64 tokens of plain decode (colibri pauses 256; 64 suits short generations), then the
window is cleared and drafting re-arms.

**Lossy routing.**  EXPERT_BUDGET in ``position`` scope (with ``none``/``pinned`` residency) is a per-position
function, so the contract holds.  ``union`` scope caps the experts of the whole verify batch, so a verify routes
differently from K+1 single decodes, and ``cache`` residency depends on what previous forwards loaded: both are
lossy under speculation (output differs from the same budget without drafts); acceptance is still reported.
"""

from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import model as M
from ..errors import GlmJaxError
from .runner import bucket
from .sampling import filtered_probs, sample
from .stats import violation_summary
from .streaming import mtp_stream

F32 = jnp.float32
DECODE_WIDTH = 4          # padded T of every decode / verify forward in the generation loop (batch invariance)
GUARD_REARM = 64          # tokens of plain decode after the guard trips
NGRAM_MAX, NGRAM_MIN = 4, 2


def decode_width(engine, k: int = 0) -> int:
    """Padded number of positions of every decode / verify forward (see the module docstring)."""
    return max(DECODE_WIDTH, k + 1)


def draft_plan(engine):
    """The speculative plan for this engine's options, or None (plain decode)."""
    o = engine.opts
    has_mtp = engine.params.get("mtp") is not None
    src = o["draft_source"]
    if src == "auto":
        src = "mtp" if (has_mtp and o["mtp"]) else "ngram"
    k = o["draft"]
    if k < 0:
        k = 3 if (src == "mtp" and has_mtp and o["mtp"]) else 0
    if k == 0:
        return None
    if k > 63:
        raise GlmJaxError(f"option 'draft': at most 63 draft tokens, got {k}")
    if src == "mtp":
        if not has_mtp:
            raise GlmJaxError(f"{engine.path}: --draft_source=mtp needs an MTP layer (num_nextn_predict_layers=1 and "
                              f"model.layers.{engine.cfg.num_hidden_layers}.* in the checkpoint)")
        if not o["mtp"]:
            return None
    return SpecPlan(k, src, o["mtp_guard_pct"], o["mtp_guard_window"])


# ----------------------------------------------------------------------------- jitted pieces
def _mtp_draft_fn(engine, k: int, samp: dict):
    """jit: catch-up window (T rows, n real) through the MTP layer, then k-1 chained single steps.
    Returns (drafts [k] int32, q [k, V] draft distributions (None for greedy), cache)."""
    key_ = ("mtp_draft", k, tuple(sorted(samp.items())))
    f = engine._jits.get(key_)
    if f is not None:
        return f
    cfg = engine.cfg
    plugin = engine.plugin or M.identity_plugin
    greedy = samp["temperature"] <= 0.0
    own = bool(engine.opts.get("mtp_own_head", False))

    def pick(logits, key):
        if greedy:
            return jnp.argmax(logits, -1).astype(jnp.int32), None
        q = filtered_probs(logits, **samp)
        return jax.random.categorical(key, jnp.log(q), axis=-1).astype(jnp.int32), q

    def f(params, cache, tokens, hidden, start, n, key, resident):
        res = resident
        lg, hn, cache, routing = M.mtp_forward(cfg, params, cache, tokens, hidden, start, n, res, plugin, own)
        last = n[0] - 1
        lg = jax.lax.dynamic_index_in_dim(lg[0], last, 0, keepdims=False)
        g = jax.lax.dynamic_index_in_dim(hn[0], last, 0, keepdims=True)[None]      # [1, 1, H]
        keys = jax.random.split(key, k)
        d, q = pick(lg, keys[0])
        ds, qs = [d], [q]
        pos = start + n[0]
        for j in range(1, k):
            lg, g, cache, r = M.mtp_forward(cfg, params, cache, d.reshape(1, 1), g, pos, None, res, plugin, own)
            routing = routing + r
            d, q = pick(lg[0, 0], keys[j])
            ds.append(d)
            qs.append(q)
            pos = pos + 1
        return jnp.stack(ds), (None if greedy else jnp.stack(qs)), cache, violation_summary(routing)

    f = engine._jits[key_] = jax.jit(f, donate_argnums=(1,))
    return f


def _mtp_draft_streamed(engine, k: int, samp: dict, tokens, hidden, start, n, key):
    """_mtp_draft_fn's computation with the MTP layer streamed (streaming.mtp_stream): the catch-up window, then
    k-1 chained single steps; returns (drafts [k], q [k, V] or None)."""
    greedy = samp["temperature"] <= 0.0
    own = bool(engine.opts.get("mtp_own_head", False))
    keys = jax.random.split(key, k)

    def pick(logits, kk):
        if greedy:
            return jnp.argmax(logits, -1).astype(jnp.int32), None
        q = filtered_probs(logits, **samp)
        return jax.random.categorical(kk, jnp.log(q), axis=-1).astype(jnp.int32), q

    lg, hn = mtp_stream(engine, tokens, hidden, start, n, own)
    last = int(n[0]) - 1
    d, q = pick(lg[0, last], keys[0])
    g = hn[:, last:last + 1]
    ds, qs = [d], [q]
    pos = start + n[0]
    for j in range(1, k):
        lg, g = mtp_stream(engine, d.reshape(1, 1), g, pos, jnp.ones((1,), jnp.int32), own)
        d, q = pick(lg[0, 0], keys[j])
        ds.append(d)
        qs.append(q)
        pos = pos + 1
    return jnp.stack(ds), (None if greedy else jnp.stack(qs))


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p", "k"))
def _accept(z, drafts, q, n_drafts, key, temperature: float, top_k: int, top_p: float, k: int):
    """Accept/reject k drafts against main logits z [k+1, V] (row j predicts the token after row j's token).

    drafts [k] int32, q [k, V] draft distributions (None: deterministic drafts, q = one-hot), n_drafts: how many of
    the k are real.  Returns (m accepted, next token)."""
    V = z.shape[-1]
    jj = jnp.arange(k)
    live = jj < n_drafts
    if temperature <= 0.0:
        a = jnp.argmax(z, -1).astype(jnp.int32)                            # [k+1]
        ok = (drafts == a[:k]) & live
        m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
        return m, a[m]
    p = filtered_probs(z, temperature, top_k, top_p)                       # [k+1, V]
    if q is None:
        q = jax.nn.one_hot(drafts, V, dtype=F32)
    ku, kr = jax.random.split(key)
    u = jax.random.uniform(ku, (k,))
    pd = jnp.take_along_axis(p[:k], drafts[:, None], -1)[:, 0]
    qd = jnp.take_along_axis(q, drafts[:, None], -1)[:, 0]
    ok = (u * qd < pd) & live                                              # u < p/q, q(d) > 0 for a drawn d
    m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    pm = p[m]
    qm = jnp.concatenate([q, jnp.zeros((1, V), F32)])[m]
    rejected = m < n_drafts
    resid = jnp.maximum(pm - qm, 0.0)
    s = resid.sum()
    dist = jnp.where(rejected & (s > 0), resid / jnp.where(s > 0, s, 1.0), pm)
    nxt = jax.random.categorical(kr, jnp.log(dist)).astype(jnp.int32)
    return m, nxt


def ngram_drafts(seq, k: int, nmax: int = NGRAM_MAX, nmin: int = NGRAM_MIN) -> list:
    """Prompt lookup: the continuation (up to k tokens) of the most recent earlier occurrence of the longest suffix
    n-gram (n = nmax..nmin) of seq."""
    L = len(seq)
    for n in range(min(nmax, L - 1), nmin - 1, -1):
        suf = seq[L - n:]
        for i in range(L - n - 1, -1, -1):
            if seq[i:i + n] == suf:
                return list(seq[i + n:i + n + k])
    return []


# ----------------------------------------------------------------------------- the plan
class SpecPlan:
    def __init__(self, k: int, source: str, guard_pct: float, guard_window: int):
        self.k = k
        self.source = source
        self.guard_pct = guard_pct
        self.guard_window = guard_window


class SpecRow:
    """Speculative decoding of one sequence whose prefill is done (the scheduler runs it on the sequence's row:
    ``Runner.row_view``).  prompt_hidden [P, H]: main hidden of the prompt positions (MTP; None for n-grams);
    ``out`` = [x_P] (sampled from the prefill logits, not yet in the cache), extended by the scheduler with what
    ``step`` returns.  Stats accumulate in ``stats()``; ``rt.last_spec_trace`` lists (position of the pending
    token, drafts, accepted) per verify."""

    def __init__(self, plan: SpecPlan, rt, prompt_ids, out, prompt_hidden, key, samp, eos):
        self.plan, self.rt = plan, rt
        self.k, self.W = plan.k, decode_width(rt, plan.k)
        self.mtp = plan.source == "mtp"
        self.streamed = rt.backend.streamed
        P = len(prompt_ids)
        self.out = out
        self.seq = list(prompt_ids) + list(out)
        self.pos = P                  # position of the pending token out[-1]
        self.st = collections.Counter()
        self.window = collections.deque(maxlen=max(1, plan.guard_window))
        self.paused_until = -1        # len(out) at which drafting re-arms
        # MTP catch-up queue: pairs (token, hidden) for MTP slots mtp_next.. (pair (x_{t+1}, h_t) in slot t)
        self.pend_tok = list(prompt_ids[1:]) + [out[-1]]
        self.pend_h = [jnp.asarray(prompt_hidden)] if prompt_hidden is not None else []
        self.mtp_next = 0
        self.key = key
        self.samp = samp
        self.eos = eos
        self.t_draft = self.t_verify = 0.0
        self.trace = rt.last_spec_trace = []

    def _main_forward(self, tokens):
        rt, W = self.rt, self.W
        t = np.zeros((1, W), np.int32)
        t[0, :len(tokens)] = tokens
        u0 = rt._route_acc.get("union_experts", 0.0)
        logits, hidden = rt.forward(t, np.array([self.pos], np.int32), np.array([len(tokens)], np.int32))
        du = rt._route_acc.get("union_experts", 0.0) - u0
        if du:
            self.st["verify_union" if len(tokens) > 1 else "decode_union"] += du
        self.st["forwards"] += 1
        return logits[0], hidden[0]

    def step(self, budget: int):
        """One draft + verify.  ``budget``: tokens the sequence may still add.  Returns (new tokens, forwards)."""
        rt, k, W, samp, st = self.rt, self.k, self.W, self.samp, self.st
        out = self.out
        kk = min(k, budget - 1)     # no drafts past the end (they could never be emitted)
        drafts, q = [], None
        if kk > 0 and len(out) >= self.paused_until:
            t0 = time.perf_counter()
            if self.mtp:
                n = len(self.pend_tok)
                T = W if n <= W else bucket(n)
                toks = np.zeros((1, T), np.int32)
                toks[0, :n] = self.pend_tok
                hid = jnp.concatenate(self.pend_h, 0)
                hid = jnp.pad(hid, ((0, T - n), (0, 0)))[None]
                self.key, sk = jax.random.split(self.key)
                if self.streamed:      # the MTP layer's experts come through the store
                    d, q = _mtp_draft_streamed(rt, k, samp, jnp.asarray(toks), hid,
                                               jnp.asarray([self.mtp_next], jnp.int32), jnp.asarray([n], jnp.int32),
                                               sk)
                else:
                    fn = _mtp_draft_fn(rt, k, samp)
                    d, q, rt._cache, viol = fn(rt.step_params(), rt._cache, jnp.asarray(toks), hid,
                                               jnp.asarray([self.mtp_next], jnp.int32), jnp.asarray([n], jnp.int32),
                                               sk, _mtp_resident(rt))
                    rt._check_routing(viol)
                self.mtp_next += n
                self.pend_tok, self.pend_h = [], []
                drafts = [int(x) for x in np.asarray(d)[:kk]]
                st["mtp_forwards"] += k
            else:
                drafts = ngram_drafts(self.seq, kk)
            self.t_draft += time.perf_counter() - t0
        t0 = time.perf_counter()
        logits, hidden = self._main_forward([out[-1]] + drafts)
        nd = len(drafts)
        if nd:
            st["verifies"] += 1
            self.key, sk = jax.random.split(self.key)
            dpad = np.zeros(k, np.int32)
            dpad[:nd] = drafts
            m, nxt = _accept(logits[:k + 1], jnp.asarray(dpad), q, jnp.asarray(nd, jnp.int32), sk, k=k, **samp)
            m, nxt = int(m), int(nxt)
            st["drafts_proposed"] += nd
            st["drafts_accepted"] += m
            self.window.extend([True] * m + [False] * (nd - m))
            if (len(self.window) == self.window.maxlen and
                    100.0 * sum(self.window) / len(self.window) < self.plan.guard_pct):
                st["guard_pauses"] += 1
                self.paused_until = len(out) + 1 + m + GUARD_REARM
                self.window.clear()
        else:
            m = 0
            self.key, sk = jax.random.split(self.key)
            nxt = int(sample(logits[0], sk, **samp))
        self.t_verify += time.perf_counter() - t0
        self.trace.append((self.pos, drafts, m))
        new = drafts[:m] + [nxt]
        # committed now: out[-1] and drafts[:m] at positions pos..pos+m; nxt is the new pending token
        if self.mtp:
            self.pend_tok += new
            self.pend_h.append(hidden[:m + 1])
        emit = []
        for t in new:
            if len(emit) >= budget or (emit and emit[-1] in self.eos) or (not emit and out[-1] in self.eos):
                break
            emit.append(t)
        self.seq.extend(emit)
        self.pos += m + 1
        return emit, 1

    def stats(self) -> dict:
        st, k = self.st, self.k
        prop = st["drafts_proposed"]
        stats = {
            "draft_source": self.plan.source, "draft_k": k, "decode_width": self.W,
            "drafts_proposed": prop, "drafts_accepted": st["drafts_accepted"],
            "mtp_acceptance": (st["drafts_accepted"] / prop) if prop else 0.0,
            "verifies": st["verifies"], "guard_pauses": st["guard_pauses"],
            "mtp_forwards": st["mtp_forwards"], "draft_s": self.t_draft, "verify_s": self.t_verify,
        }
        n_moe = len(self.rt.moe_layers) or 1
        if st["verifies"] and "verify_union" in st:
            stats["verify_union_per_layer"] = st["verify_union"] / st["verifies"] / n_moe
        plain = st["forwards"] - st["verifies"]
        if plain and "decode_union" in st:
            stats["decode_union_per_layer"] = st["decode_union"] / plain / n_moe
        return stats


def _mtp_resident(engine):
    """What the routing plugins see as resident for the MTP layer."""
    return jnp.asarray(engine.resident_for(engine.cfg.num_hidden_layers))
