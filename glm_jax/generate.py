"""Token generation: prefill, the decode loop, sampling (greedy / temperature / top-k / nucleus top-p), stats."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from .config import GlmJaxError

F32 = jnp.float32


def filtered_probs(logits, temperature: float, top_k: int, top_p: float):
    """The sampling distribution [..., V] after temperature, top-k and nucleus top-p (greedy: one-hot argmax)."""
    logits = logits.astype(F32)
    V = logits.shape[-1]
    if temperature <= 0.0:
        return jax.nn.one_hot(jnp.argmax(logits, -1), V, dtype=F32)
    z = logits / temperature
    if 0 < top_k < V:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    p = jax.nn.softmax(z, -1)
    if top_p < 1.0:
        order = jnp.argsort(-p, axis=-1)
        ps = jnp.take_along_axis(p, order, -1)
        cum = jnp.cumsum(ps, -1)
        keep_sorted = (cum - ps) < top_p                 # always keeps the most likely token
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), -1)
        p = jnp.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdims=True)
    return p


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(logits, key, temperature: float, top_k: int, top_p: float):
    """Sample one token per row of logits [..., V]."""
    if temperature <= 0.0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    p = filtered_probs(logits, temperature, top_k, top_p)
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)


def generate(engine, prompt_or_ids, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0, chat=False,
             stop_on_eos=True):
    if isinstance(prompt_or_ids, str):
        ids = engine.encode(prompt_or_ids, chat=chat)
    else:
        ids = [int(t) for t in prompt_or_ids]
        if chat:
            raise GlmJaxError("generate: chat=True needs a text prompt")
    if not ids:
        raise GlmJaxError("generate: empty prompt")
    V = engine.cfg.vocab_size
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise GlmJaxError(f"generate: token id {bad[0]} outside the vocabulary [0, {V})")
    if max_new_tokens < 0:
        raise GlmJaxError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    if top_p <= 0.0 or top_p > 1.0:
        raise GlmJaxError(f"option 'top_p': must be in (0, 1], got {top_p}")
    eos = set(engine.cfg.eos_token_ids) if stop_on_eos else set()
    engine._route_acc = {}
    if engine.store is not None:
        engine.store.reset_stats()

    from .speculative import decode_width, draft_plan

    plan = draft_plan(engine)
    P = len(ids)
    need = P + max_new_tokens + (plan.k + 2 if plan else 1)
    engine._ensure_cache(1, need)
    key = jax.random.PRNGKey(seed)
    samp = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))

    compile0 = engine.compile_s
    t0 = time.perf_counter()
    T = _bucket(P)
    toks = np.zeros((1, T), np.int32)
    toks[0, :P] = ids
    last = np.zeros((1, T), bool)
    last[0, P - 1] = True            # only the last position's logits are needed
    logits, hidden = engine.forward(toks, np.zeros(1, np.int32), np.array([P], np.int32), logit_rows=last)
    key, sk = jax.random.split(key)
    nxt = int(sample(logits[0, P - 1], sk, **samp))
    prefill_s = time.perf_counter() - t0 - (engine.compile_s - compile0)
    compile1 = engine.compile_s
    store_prefill = engine.store.stats() if engine.store is not None else None
    engine._route_acc = {}

    out = []
    t1 = time.perf_counter()
    forwards = 0
    spec_stats = {}
    if max_new_tokens > 0:
        out.append(nxt)
        if plan is not None and not (nxt in eos):
            out, forwards, spec_stats, key = plan.run(engine, ids, out, hidden[0, :P], key, samp,
                                                      max_new_tokens, eos)
        elif engine.opts["fetch"] == "resident":
            # many tokens per dispatch: the step and the sampler in one compiled loop (no host round trip per token)
            forwards, key = _fused_decode(engine, out, P, key, samp, max_new_tokens, eos)
        else:
            pos = P
            # decode at the same padded width as a speculative verify (batch invariance: speculative.py)
            W = decode_width(engine)
            while len(out) < max_new_tokens and out[-1] not in eos:
                dtok = np.zeros((1, W), np.int32)
                dtok[0, 0] = out[-1]
                logits, hidden = engine.forward(dtok, np.array([pos], np.int32), np.array([1], np.int32))
                forwards += 1
                key, sk = jax.random.split(key)
                out.append(int(sample(logits[0, 0], sk, **samp)))
                pos += 1
    decode_s = time.perf_counter() - t1 - (engine.compile_s - compile1)
    # the first new token comes from the prefill forward; decode tokens are the ones after it
    n_dec = max(len(out) - 1, 0)
    stats = {
        "prefill_tokens": P, "prefill_s": prefill_s,
        "decode_tokens": n_dec, "decode_s": decode_s,
        "decode_tok_s": (n_dec / decode_s) if decode_s > 0 and n_dec else 0.0,
        "new_tokens": len(out), "forwards": forwards,
        "tokens_per_forward": (n_dec / forwards) if forwards else 0.0,
        "fetch": engine.opts["fetch"], "compile_s": engine.compile_s - compile0,
        "dtype": jnp.dtype(engine.dtype).name, "checkpoint_dtype": engine.checkpoint_dtype, "kernels": engine.kernel,
    }
    stats.update(spec_stats)
    stats.update(route_stats(engine._route_acc))
    if engine.store is not None:
        st = engine.store.stats()
        stats.update(_store_stats(st, store_prefill, n_dec))
    text = engine.decode(out)
    from .engine import GenerationResult

    return GenerationResult(tokens=out, text=text, stats=stats, prompt_tokens=ids)


FUSED_CHUNK = 32      # decode tokens per dispatch of the compiled loop (at most; it stops early at EOS)


def _fused_decode(engine, out: list, P: int, key, samp: dict, max_new_tokens: int, eos: set):
    """Plain decode with resident experts, FUSED_CHUNK tokens per dispatch: ``lax.while_loop`` over (step at the
    padded decode width -> sample -> stop at EOS / the budget) on the device.  Same step function, same width,
    same key sequence as the one-forward-per-token loop.  Appends to ``out``; returns (forwards, key)."""
    from .speculative import decode_width

    W = decode_width(engine)
    fn = _fused_decode_fn(engine, samp, W)
    ev = np.full(max(1, len(eos)), -1, np.int32)
    ev[:len(eos)] = sorted(eos)
    eos_arr = jnp.asarray(ev)
    resident = engine._resident_masks()
    params = engine.step_params()
    pos, forwards = P, 0
    while len(out) < max_new_tokens and out[-1] not in eos:
        n = min(FUSED_CHUNK, max_new_tokens - len(out))
        engine._cache, toks, cnt, key, acc = fn(params, engine._cache, jnp.int32(out[-1]), jnp.int32(pos), key,
                                                jnp.int32(n), eos_arr, resident)
        cnt = int(cnt)
        if not bool(acc.pop("_finite")):
            from .config import NonFiniteError

            raise NonFiniteError(f"{engine.path}: the model produced NaN/Inf logits (positions {pos}..{pos + cnt - 1}); "
                                 f"the weights or activations overflow {jnp.dtype(engine.dtype).name} "
                                 "(try --dtype=float32)")
        out.extend(int(t) for t in np.asarray(toks)[:cnt])
        engine._accumulate(acc)
        pos += cnt
        forwards += cnt
    return forwards, key


def _fused_decode_fn(engine, samp: dict, W: int):
    key_ = ("fused_decode", W, tuple(sorted(samp.items())))
    f = engine._jits.get(key_)
    if f is not None:
        return f
    from . import model as M
    from .engine import _routing_summary

    cfg = engine.cfg
    plugin = engine.plugin or M.identity_plugin
    want_stats = engine.plugin is not None

    def one(params, cache, tok, pos, key, resident):
        toks = jnp.zeros((1, W), jnp.int32).at[0, 0].set(tok)
        logits, _, cache, routing = M.step(cfg, params, cache, toks, pos[None], jnp.ones((1,), jnp.int32), resident,
                                           plugin, moe_rows=1)
        key, sk = jax.random.split(key)
        nxt = sample(logits[0, 0], sk, **samp)
        summ = dict(_routing_summary(routing, want_stats))
        summ["_finite"] = jnp.all(jnp.isfinite(logits[0, 0]))
        return cache, nxt, key, summ

    def f(params, cache, tok, pos, key, n, eos, resident):
        acc0 = {k: (jnp.ones(a.shape, a.dtype) if k == "_finite" else jnp.zeros(a.shape, a.dtype))
                for k, a in jax.eval_shape(one, params, cache, tok, pos, key, resident)[3].items()}

        def body(c):
            cache, nxt, key, summ = one(params, c["cache"], c["tok"], c["pos"], c["key"], resident)
            return dict(cache=cache, tok=nxt, pos=c["pos"] + 1, key=key, i=c["i"] + 1,
                        out=c["out"].at[c["i"]].set(nxt), done=jnp.any(nxt == eos),
                        acc={k: (c["acc"][k] & v) if k == "_finite" else c["acc"][k] + v for k, v in summ.items()})

        c = jax.lax.while_loop(lambda c: (c["i"] < n) & ~c["done"], body,
                               dict(cache=cache, tok=tok, pos=pos, key=key, i=jnp.int32(0),
                                    out=jnp.zeros((FUSED_CHUNK,), jnp.int32), done=jnp.bool_(False), acc=acc0))
        return c["cache"], c["out"], c["i"], c["key"], c["acc"]

    f = engine._jits[key_] = jax.jit(f, donate_argnums=(1,))
    return f


def _bucket(n):
    from .engine import _bucket as b

    return b(n)


def route_stats(acc: dict) -> dict:
    """Routing-plugin telemetry accumulated over forwards (sums over MoE layers per forward, see
    glm_jax_plugins.stats) turned into per-run numbers; union sizes come from the streaming path."""
    out = {"experts_dropped": int(acc.get("dropped", 0))}
    n = acc.get("layers", 0.0)
    if n:
        out["substitutions"] = int(acc.get("substitutions", 0))
        out["rescued"] = int(acc.get("rescued", 0))
        out["route_agreement"] = acc.get("route_agreement", 0.0) / n
        out["route_kl"] = acc.get("kl", 0.0) / n
        out["distinct_experts_before"] = acc.get("distinct_before", 0.0) / n
        out["distinct_experts_after"] = acc.get("distinct_after", 0.0) / n
    if acc.get("moe_layer_forwards"):
        out["union_per_layer"] = acc["union_experts"] / acc["moe_layer_forwards"]
    if acc.get("prefetch_recall_total"):
        out["prefetch_recall"] = acc["prefetch_recall_hits"] / acc["prefetch_recall_total"]
    return out


def _store_stats(total: dict, prefill: dict, n_dec: int) -> dict:
    """Store counters for the whole call and for decode only (total minus what prefill had done)."""
    out = {k: v for k, v in total.items() if isinstance(v, (int, float))}
    if prefill is not None:
        for k in ("bytes_read", "expert_loads", "hits", "misses", "sim_bytes", "sim_io_s"):
            if k in total and k in prefill:
                out["decode_" + k] = total[k] - prefill[k]
        if n_dec and "decode_bytes_read" in out:
            out["bytes_read_per_token"] = out["decode_bytes_read"] / n_dec
    return out
