"""The routing-plugin contract, made checkable (used by the engine for user plugins and by ``glm-jax-eval
--check_contract``; never imports ``glm_jax``).

A plugin ``RoutingState -> RoutingState`` must:

1. return a RoutingState with the same pytree structure, shapes and dtypes as its input and the same static fields
   (``rescued`` may go from None to ``[T] bool``, as the expert budget does);
2. leave every real row (``positions`` True) that had a valid expert with at least one;
3. give every valid slot a finite, non-negative weight and an expert id in ``[0, E)``;
4. not change the router's view (``scores``, ``biased``), ``resident``, ``positions``, ``layer``, ``seq_pos``.

How it is checked (:func:`checked`):

* (1) at TRACE time, from shapes alone (:func:`structure_problem`): the wrapper raises at once, with a one-line
  message naming the plugin.  The engine also traces every user plugin at load on an abstract state
  (``jax.eval_shape`` of :func:`abstract_state`, layer index traced), so a shape error, or a Python ``if`` on a traced
  value, is reported by ``Engine.load`` before anything runs.
* (2)-(4) depend on values, so they are computed INSIDE the jitted forward (:func:`value_flags`: a few reductions over
  ``[T, K]`` / ``[T, E]``, cheap next to the layer) and folded into ``state.violation``: 0, or
  ``(index + 1) * 32 + flags`` of the first plugin (in composition order) that broke them.  The engine reads it back
  with the routing summary it already transfers after every forward and raises (:func:`describe`).  The forward that
  broke the contract has run by then; its results are not returned.

:func:`classify` probes a plugin's kind on synthetic router-like states: cache-dependent (its output changes with
``resident``) and row-independent (a row's result is the same alone as inside a batch).  A routing-only,
row-independent plugin keeps MTP's contract (greedy output with drafts == without); ``glm-jax-eval
--check_contract`` checks that on the real model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .routing import Plugin, RoutingState

EMPTY_ROW, NONFINITE, NEGATIVE, BAD_ID, READ_ONLY_CHANGED = 1, 2, 4, 8, 16
_FLAG_TEXT = ((EMPTY_ROW, "left a real row with no expert"), (NONFINITE, "gave a valid slot a NaN/inf weight"),
              (NEGATIVE, "gave a valid slot a negative weight"), (BAD_ID, "picked an expert id outside [0, E)"),
              (READ_ONLY_CHANGED, "changed scores/biased/resident/positions/layer/seq_pos"))
READ_ONLY = ("scores", "biased", "resident", "positions", "layer", "seq_pos")
_SAME = ("ids", "weights", "valid") + READ_ONLY + ("violation",)
_STATIC = ("norm_topk_prob", "routed_scaling_factor", "num_layers")
CODE_BASE = 32


def _sig(x):
    return None if x is None else (tuple(np.shape(x)), jnp.result_type(x))


def structure_problem(before: RoutingState, after) -> str | None:
    """What is wrong with ``after``'s structure (types, shapes, dtypes, static fields), or None. Trace-time only."""
    if not isinstance(after, RoutingState):
        return f"returned {type(after).__name__}, not a RoutingState"
    for f in _SAME:
        a, b = _sig(getattr(before, f)), _sig(getattr(after, f))
        if a != b:
            if b is None:
                return f"dropped field '{f}' (build the output with state.replace(...))"
            return f"changed '{f}' from {_fmt(a)} to {_fmt(b)}"
    r = _sig(after.rescued)
    if r is not None and r != ((before.positions.shape[0],), jnp.dtype(bool)):
        return f"set 'rescued' to {_fmt(r)} (expected [T] bool)"
    for f in _STATIC:
        if getattr(before, f) != getattr(after, f):
            return f"changed static field '{f}' ({getattr(before, f)!r} -> {getattr(after, f)!r})"
    return None


def _fmt(sig):
    return "None" if sig is None else f"{list(sig[0])} {sig[1]}"


def value_flags(before: RoutingState, after: RoutingState):
    """int32 scalar: OR of the flags of the value rules (2)-(4) ``after`` breaks (jittable)."""
    E = before.scores.shape[-1]
    real = before.positions.astype(bool)
    valid = after.valid.astype(bool)
    empty = jnp.any(real & jnp.any(before.valid, -1) & ~jnp.any(valid, -1))
    w = after.weights
    nonfinite = jnp.any(valid & ~jnp.isfinite(w))
    negative = jnp.any(valid & (w < 0))
    bad_id = jnp.any(valid & ((after.ids < 0) | (after.ids >= E)))
    changed = jnp.bool_(False)
    for f in READ_ONLY:
        a, b = getattr(before, f), getattr(after, f)
        if a is not None and b is not None and a is not b:
            changed = changed | jnp.any(jnp.asarray(a) != jnp.asarray(b))
    flags = [(empty, EMPTY_ROW), (nonfinite, NONFINITE), (negative, NEGATIVE), (bad_id, BAD_ID),
             (changed, READ_ONLY_CHANGED)]
    return sum(jnp.where(c, jnp.int32(v), jnp.int32(0)) for c, v in flags)


def describe(flags: int) -> str:
    return "; ".join(t for f, t in _FLAG_TEXT if int(flags) & f)


def decode(code: int):
    """``(plugin index, flags)`` of a nonzero ``violation`` code."""
    code = int(code)
    return code // CODE_BASE - 1, code % CODE_BASE


def name_of(p) -> str:
    return getattr(p, "name", None) or getattr(p, "__name__", None) or type(p).__name__


def checked(plugin, index: int, name: str | None = None, error=ValueError) -> Plugin:
    """``plugin`` with the contract checks (module docstring): structure at trace time (raises ``error`` with a
    one-line message naming the plugin), values in-jit into ``state.violation`` (code ``(index + 1) * 32 + flags``
    unless an earlier plugin already set one)."""
    name = name or name_of(plugin)

    def apply(state: RoutingState) -> RoutingState:
        try:
            out = plugin(state)
        except Exception as e:                                           # noqa: BLE001 - reported, one line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            hint = (" (state.layer / state.seq_pos are traced inside the engine: branch with jnp.where, not a "
                    "Python if)") if "Tracer" in type(e).__name__ or "Concretization" in type(e).__name__ else ""
            raise error(f"routing plugin '{name}' failed: {type(e).__name__}: {msg}{hint}") from None
        prob = structure_problem(state, out)
        if prob:
            raise error(f"routing plugin '{name}' broke the contract: {prob}")
        v = jnp.int32(0) if state.violation is None else state.violation
        flags = value_flags(state, out)
        code = jnp.where((v == 0) & (flags != 0), jnp.int32((index + 1) * CODE_BASE) + flags, v)
        return out.replace(violation=code)

    return Plugin(apply, name)


def abstract_state(T: int, K: int, E: int, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                   num_layers: int = 0) -> RoutingState:
    """A RoutingState of ``jax.ShapeDtypeStruct`` leaves (for ``jax.eval_shape``): what the engine hands a plugin."""
    S = jax.ShapeDtypeStruct
    return RoutingState(ids=S((T, K), jnp.int32), weights=S((T, K), jnp.float32), valid=S((T, K), jnp.bool_),
                        scores=S((T, E), jnp.float32), biased=S((T, E), jnp.float32), resident=S((E,), jnp.bool_),
                        positions=S((T,), jnp.bool_), layer=S((), jnp.int32), seq_pos=S((T,), jnp.int32),
                        violation=S((), jnp.int32), norm_topk_prob=norm_topk_prob,
                        routed_scaling_factor=float(routed_scaling_factor), num_layers=num_layers)


def router_state(rng, T: int, K: int, E: int, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 layer: int = 0, num_layers: int = 0, resident=None, start: int = 0) -> RoutingState:
    """A concrete state built the way the GLM router builds one, from random logits (numpy ``rng``)."""
    s = (1.0 / (1.0 + np.exp(-2.0 * rng.normal(size=(T, E))))).astype(np.float32)
    biased = (s + 0.1 * rng.normal(size=E).astype(np.float32)).astype(np.float32)
    ids = np.argsort(-biased, axis=-1, kind="stable")[:, :K].astype(np.int32)
    w = np.take_along_axis(s, ids, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + np.float32(1e-20))
    w = (w * np.float32(routed_scaling_factor)).astype(np.float32)
    res = np.zeros(E, bool) if resident is None else np.asarray(resident, bool)
    return RoutingState(ids=jnp.asarray(ids), weights=jnp.asarray(w), valid=jnp.ones((T, K), bool),
                        scores=jnp.asarray(s), biased=jnp.asarray(biased), resident=jnp.asarray(res),
                        positions=jnp.ones((T,), bool), layer=jnp.int32(layer),
                        seq_pos=jnp.arange(start, start + T, dtype=jnp.int32), violation=jnp.int32(0),
                        norm_topk_prob=norm_topk_prob, routed_scaling_factor=float(routed_scaling_factor),
                        num_layers=num_layers)


def _decision(state: RoutingState):
    valid = np.asarray(state.valid, bool)
    return np.where(valid, np.asarray(state.ids), -1), valid, np.where(valid, np.asarray(state.weights), 0.0)


def _same(a, b, rows=slice(None), atol=1e-6) -> bool:
    ia, va, wa = _decision(a)
    ib, vb, wb = _decision(b)
    return (np.array_equal(ia[rows], ib) and np.array_equal(va[rows], vb)
            and np.allclose(wa[rows], wb, rtol=1e-5, atol=atol))


def classify(plugin, K: int, E: int, layers, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
             num_layers: int = 0, T: int = 4, seeds: int = 4) -> dict:
    """Probe ``plugin`` on ``seeds`` x ``len(layers)`` synthetic router states of T rows (jitted: the layer index is
    traced, as in the engine):

    * ``cache_dependent``: its decision changes when only ``resident`` changes (nothing / everything / half of the
      experts resident);
    * ``row_independent``: each row's decision is the same when the row runs alone (T=1) at the same position;
    * ``value_flags``: OR of :func:`value_flags` over every probe (0 = none of the value rules broken).

    A behavioural probe: it can show a dependence, never prove its absence."""
    fn = jax.jit(plugin)
    flags_of = jax.jit(value_flags)
    rng = np.random.default_rng(0)
    masks = [np.zeros(E, bool), np.ones(E, bool), rng.random(E) < 0.5]
    cache_dep, row_dep, flags = False, False, 0
    for seed in range(seeds):
        for layer in layers:
            r = np.random.default_rng(1000 * seed + int(layer))
            base = router_state(r, T, K, E, norm_topk_prob, routed_scaling_factor, int(layer), num_layers,
                                start=int(r.integers(0, 64)))
            outs = []
            for m in masks:
                st = base.replace(resident=jnp.asarray(m))
                out = fn(st)
                flags |= int(flags_of(st, out))
                outs.append(out)
            cache_dep |= not all(_same(outs[0], o) for o in outs[1:])
            for t in range(T):
                row = base.replace(resident=jnp.asarray(masks[2]),
                                   **{f: getattr(base, f)[t:t + 1] for f in ("ids", "weights", "valid", "scores",
                                                                              "biased", "positions", "seq_pos")})
                row_dep |= not _same(outs[2], fn(row), rows=slice(t, t + 1))
    return {"cache_dependent": bool(cache_dep), "row_independent": not row_dep, "value_flags": flags,
            "kind": "cache-dependent" if cache_dep else "routing-only"}
