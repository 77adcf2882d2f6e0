"""Run statistics: per-forward routing numbers (inside jit: plugin stats, the user plugins' contract check) and
their per-run assembly (route_stats, store_stats), shared by the runner, the streamed forward, speculation, the
scheduler and glm-jax-eval."""

from __future__ import annotations

import jax.numpy as jnp

import glm_jax_plugins as P


def routing_summary(routing, want_stats: bool) -> dict:
    """Per-forward routing numbers summed over MoE layers (inside jit): plugin stats when a plugin is active, and
    the user plugins' contract check (violation_summary)."""
    if not want_stats or not routing:
        return {}
    out = {}
    for before, after in routing:
        for k, v in P.stats(before, after).items():
            out[k] = out.get(k, 0.0) + v
    out["layers"] = jnp.asarray(len(routing), jnp.float32)
    out.update(violation_summary(routing))
    return out

def violation_summary(routing) -> dict:
    """The first contract violation over a forward's MoE layers (inside jit): {} when no plugin is checked, else
    {"violation": code (0 = none), "violation_layer": its layer index}."""
    out = {}
    for _, after in routing:
        if after.violation is None:
            continue
        layer = jnp.asarray(-1 if after.layer is None else after.layer, jnp.int32)
        if not out:
            out = {"violation": after.violation, "violation_layer": layer}
        else:
            first = out["violation"] == 0
            out = {"violation": jnp.where(first, after.violation, out["violation"]),
                   "violation_layer": jnp.where(first, layer, out["violation_layer"])}
    return out

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

def store_stats(total: dict, prefill: dict, n_dec: int) -> dict:
    """Store counters for the whole call and for decode only (total minus what prefill had done)."""
    out = {k: v for k, v in total.items() if isinstance(v, (int, float))}
    if prefill is not None:
        for k in ("bytes_read", "expert_loads", "hits", "misses", "sim_bytes", "sim_io_s"):
            if k in total and k in prefill:
                out["decode_" + k] = total[k] - prefill[k]
        if n_dec and "decode_bytes_read" in out:
            out["bytes_read_per_token"] = out["decode_bytes_read"] / n_dec
    return out
