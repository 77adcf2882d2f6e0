"""Engine options: one table shared by the absl flags of every command and by ``Engine.load(**options)``.

Each option has a flag of the same name.  The original engine's environment names (colibri: EXPERT_BUDGET, TOPP,
MTP, ...) are accepted as aliases; an explicitly given flag or keyword always wins over the environment.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from .config import GlmJaxError


class OptionError(GlmJaxError):
    pass


@dataclasses.dataclass(frozen=True)
class Opt:
    name: str
    default: Any
    kind: str            # "str" | "int" | "float" | "bool" | "enum"
    help: str
    choices: tuple = ()
    env: tuple = ()      # environment aliases (original engine's names)


OPTIONS = [
    Opt("dtype", "auto", "enum", "Compute (activation) dtype. auto: float32 on CPU whatever the checkpoint declares "
        "(XLA:CPU has no fast bf16 arithmetic; the native kernels keep bf16 weights in bf16 and compute in f32), "
        "the checkpoint's declared dtype elsewhere. The stats line prints what was picked.",
        ("auto", "float32", "bfloat16")),
    Opt("kernels", "auto", "enum", "Expert (and quantized dense) matrix products: native (C++ kernels through jax.ffi, "
        "built on first use with the machine's C++ compiler into the per-user cache; int8 activations x int4/int8 "
        "weights with AVX-512 VNNI where present), xla (jnp code, no compiler needed), auto (native if it builds, "
        "else xla with a warning).", ("auto", "native", "xla")),
    Opt("dense_format", "native", "str", "Storage format of the dense (non-expert) matrices at run time: native (as "
        "stored: the checkpoint's dtype, or the container's --dense_format), f32, bf16, int8_row, int4_g64 "
        "(quantized at load; the lm_head stays int8 for int4 formats). Quantized dense weights need the native "
        "kernels to be fast."),
    Opt("max_seq_len", 0, "int", "KV-cache capacity in tokens (0: prompt + max_new_tokens, rounded up)."),
    Opt("fetch", "auto", "enum", "How routed experts reach the MoE seam: resident (all in memory, one jit per token), "
        "loop (Python layer loop calling the expert store between jitted dense functions), callback (the store is "
        "called from inside one compiled step via io_callback). auto: resident for plain HF dirs that fit, loop for "
        "converted containers.", ("auto", "resident", "loop", "callback")),
    Opt("expert_format", "native", "str", "Storage format of resident experts: native (checkpoint dtype), f32, bf16, "
        "int8_row, int4_row, int4_g64."),
    Opt("cache_cap", 0, "int", "Expert-store cache capacity in experts per layer (0: size from --ram_gb).",
        env=("CAP",)),
    Opt("ram_gb", 0.0, "float", "RAM budget in GB for dense + KV + expert cache + buffers (0: 0.8 x MemAvailable).",
        env=("RAM_GB",)),
    Opt("direct_io", False, "bool", "Read experts with O_DIRECT (bypass the page cache).", env=("DIRECT",)),
    Opt("io_threads", 4, "int", "Parallel expert reads.", env=("PIPE_WORKERS",)),
    Opt("overlap", False, "bool", "fetch=loop: start the layer's resident (hit) experts and the shared expert before "
        "reading its misses, so the reads overlap that compute (decode-sized forwards; exact). Off by default: with "
        "static shapes the routed terms are computed twice, which cost more than it hid on a 2-core CPU "
        "(measured; see README).", env=("PIPE",)),
    Opt("read_chunk_mb", 1.0, "float", "Split each expert read into a multiple of io_threads near-equal byte "
        "ranges of at most this many MB, so a layer's few large misses keep every I/O thread busy to the end "
        "(0: one read per expert)."),
    Opt("prefetch", False, "bool", "Router-lookahead prefetch: apply layer L+1's router to layer L's state and load "
        "its predicted experts into free cache slots in the background while layer L computes (recall and "
        "prefetch_hits / prefetch_unused are reported).", env=("PILOT",)),
    Opt("pin", "", "str", "Pinned hot set: 'auto' (usage history in the model dir) or a usage file path.",
        env=("PIN",)),
    Opt("pin_gb", 0.0, "float", "RAM for the pinned hot set in GB.", env=("PIN_GB",)),
    Opt("cache_policy", "lru", "str", "Expert cache eviction policy (see the store docs).", env=("COLI_POLICY_CACHE",)),
    Opt("sim_disk_gbps", 0.0, "float", "Benchmark aid: after each expert read, also wait as if every loaded expert "
        "were --sim_expert_mb MB on a disk of this bandwidth (reported as sim_io_s; bytes_read stays real). 0 = off."),
    Opt("sim_expert_mb", 19.0, "float", "Simulated expert size for --sim_disk_gbps (GLM-5.2 int4: ~19 MB)."),
    Opt("route_trace", "", "str", "Append the routing of every streamed forward to this jsonl file (one forward per "
        "line: [[layer, [expert ids]], ...]); tools/cache_sim.py replays it.", env=("ROUTE_TRACE",)),
    Opt("expert_topp", 1.0, "float", "TOPP: per position keep the shortest prefix of experts (by gate weight) whose "
        "cumulative weight >= p x total; 1.0 = off. Lossy.", env=("TOPP",)),
    Opt("expert_budget", 0, "int", "EXPERT_BUDGET=N: cap distinct experts per layer (miss-aware); 0 = off. Lossy.",
        env=("EXPERT_BUDGET",)),
    Opt("budget_scope", "union", "enum", "union: cap the batch union (the seed); position: cap each position on its "
        "own (batch-invariant).", ("union", "position")),
    Opt("budget_residency", "cache", "enum", "What counts as a hit for the budget: cache (live cache + pinned), "
        "pinned (static pinned set), none (pure function of routing).", ("cache", "pinned", "none")),
    Opt("budget_max_positions", 4, "int", "Apply the budget only to forwards with at most this many real positions "
        "(decode and MTP verify; never prefill). 0 = always."),
    Opt("cache_route", "off", "enum", "CACHE_ROUTE: prefer resident experts. max_rank (keep the true top-J, fill the "
        "rest with resident experts within the top-M) or prior (add lambda to resident scores). Lossy.",
        ("off", "max_rank", "prior"), env=("CACHE_ROUTE",)),
    Opt("route_j", 2, "int", "CACHE_ROUTE max_rank: true top-J always kept.", env=("ROUTE_J",)),
    Opt("route_m", 12, "int", "CACHE_ROUTE max_rank: substitution window top-M.", env=("ROUTE_M",)),
    Opt("route_alpha", 1.0, "float", "CACHE_ROUTE max_rank: weight multiplier of substitutes.", env=("ROUTE_ALPHA",)),
    Opt("route_lambda", 0.1, "float", "CACHE_ROUTE prior: score bonus of resident experts.", env=("ROUTE_LAMBDA",)),
    Opt("mtp", False, "bool", "Speculative decoding with the model's MTP layer when it has one (--mtp; off by "
        "default: on the shipped model it decoded 3.3x slower than plain decode on CPU, 529 vs 1756 tok/s with "
        "44% acceptance, README). Greedy output is identical either way.", env=("MTP",)),
    Opt("draft", -1, "int", "Draft tokens per step (-1: 3 with --mtp and an MTP layer, else 0).",
        env=("DRAFT",)),
    Opt("draft_source", "auto", "enum", "Where drafts come from: auto (mtp if present), mtp, ngram (prompt lookup).",
        ("auto", "mtp", "ngram")),
    Opt("mtp_guard_pct", 70.0, "float", "Pause drafting when acceptance over the window drops below this %.",
        env=("COLI_MTP_GUARD_PCT",)),
    Opt("mtp_guard_window", 24, "int", "Proposals in the acceptance guard's window.", env=("COLI_MTP_GUARD_WINDOW",)),
]

BY_NAME = {o.name: o for o in OPTIONS}


def _parse(o: Opt, v: Any, where: str):
    try:
        if o.kind == "int":
            return int(v)
        if o.kind == "float":
            return float(v)
        if o.kind == "bool":
            if isinstance(v, str):
                if v.lower() in ("1", "true", "yes", "on"):
                    return True
                if v.lower() in ("0", "false", "no", "off", ""):
                    return False
                raise ValueError(v)
            return bool(v)
        if o.kind == "enum":
            v = str(v)
            if v not in o.choices:
                raise ValueError(v)
            return v
        return str(v)
    except (TypeError, ValueError):
        exp = f"one of {', '.join(o.choices)}" if o.kind == "enum" else f"a {o.kind}"
        raise OptionError(f"{where}: invalid value {v!r} (expected {exp})") from None


def resolve(explicit: Optional[dict] = None, environ=None) -> dict:
    """Defaults <- environment aliases <- explicit values (flags or keywords).  Unknown names are errors."""
    environ = os.environ if environ is None else environ
    explicit = dict(explicit or {})
    out = {}
    for o in OPTIONS:
        out[o.name] = o.default
        for e in o.env:
            if e in environ and environ[e] != "":
                out[o.name] = _parse(o, environ[e], f"environment variable {e} (alias of option '{o.name}')")
                break
    for k, v in explicit.items():
        if k not in BY_NAME:
            raise OptionError(f"option '{k}': unknown (known: {', '.join(sorted(BY_NAME))})")
        out[k] = _parse(BY_NAME[k], v, f"option '{k}'")
    return out


def define_flags(flags_module=None):
    """Define one absl flag per option (idempotent)."""
    from absl import flags

    F = flags_module or flags
    for o in OPTIONS:
        if o.name in F.FLAGS:
            continue
        h = o.help + (f" [env alias: {', '.join(o.env)}]" if o.env else "")
        if o.kind == "int":
            F.DEFINE_integer(o.name, o.default, h)
        elif o.kind == "float":
            F.DEFINE_float(o.name, o.default, h)
        elif o.kind == "bool":
            F.DEFINE_boolean(o.name, o.default, h)
        elif o.kind == "enum":
            F.DEFINE_enum(o.name, o.default, list(o.choices), h)
        else:
            F.DEFINE_string(o.name, o.default, h)


def from_flags() -> dict:
    """Options from parsed absl flags: only flags given on the command line count as explicit (so env aliases apply
    to the others)."""
    from absl import flags

    F = flags.FLAGS
    explicit = {o.name: F[o.name].value for o in OPTIONS if F[o.name].present}
    return resolve(explicit)
