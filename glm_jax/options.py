"""Engine options: one table shared by the absl flags of every command and by ``Engine.load(**options)``.

Each option has a flag of the same name and its range (``lo`` / ``hi`` / ``check``): the flag, the environment
alias and the keyword get the same check and the same error text, prefixed by where the value came from.  The
exception is ``plugins`` (user routing plugins), whose flags are ``--plugin`` (repeatable) and ``--plugin_args``:
:func:`define_flags` defines them for every command that takes engine options (glm-jax, glm-jax-eval,
glm-jax-serve), and :func:`from_flags` turns them into the ``plugins`` option.  The original engine's environment
names (colibri: EXPERT_BUDGET, TOPP, MTP, ...) are accepted as aliases only when asked for (``--colibri_env``,
``Engine.load(colibri_env=True)``: generic names like PIN or CAP in an unrelated shell must change nothing); an
explicitly given flag or keyword always wins over the environment (an alias is not even parsed then).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import math
import os
import re
from typing import Any, Callable, Optional

from glm_jax_plugins import Plugin

from . import fileio
from .errors import GlmJaxError, PluginError  # noqa: F401  (PluginError re-exported)


class OptionError(GlmJaxError):
    pass


@dataclasses.dataclass(frozen=True)
class Opt:
    name: str
    default: Any
    kind: str            # "str" | "int" | "float" | "bool" | "enum" | "plugins"
    help: str
    choices: tuple = ()
    env: tuple = ()      # environment aliases (original engine's names)
    lo: Optional[float] = None        # inclusive lower bound (int / float)
    hi: Optional[float] = None        # inclusive upper bound
    lo_open: bool = False             # lo is exclusive
    check: Optional[Callable] = None  # value -> None | "what is wrong" (str options)
    main: bool = False                # listed by `glm-jax --help`


def _expert_format(v: str) -> Optional[str]:
    if v in ("native", "auto", "f32", "bf16", "int8_row", "int4_row"):
        return None
    m = re.fullmatch(r"int4_g(\d+)", v)
    if m and int(m.group(1)) >= 2 and int(m.group(1)) % 2 == 0:
        return None
    return ("unknown expert format (expected native, f32, bf16, int8_row, int4_row or int4_g<N> with N an even "
            "group size >= 2, e.g. int4_g64)")


def _pin(v: str) -> Optional[str]:
    if v in ("", "auto") or os.path.isfile(v):
        return None
    return "file not found (expected 'auto' or a usage-history file)"


def _writable_file(v: str) -> Optional[str]:
    return None if v == "" else writable_problem(v)


def _mesh(v: str) -> Optional[str]:
    """None if ``v`` is a valid --mesh value ('' = default, or axis:size pairs), else what is wrong."""
    if v == "":
        return None
    seen = set()
    for part in v.split(","):
        m = re.fullmatch(r"\s*(expert|model)\s*:\s*(\d+)\s*", part)
        if not m or int(m.group(2)) < 1:
            return "expected axis:size pairs of the axes expert and model, e.g. expert:4,model:2"
        if m.group(1) in seen:
            return f"axis {m.group(1)} given twice"
        seen.add(m.group(1))
    return None


def _coordinator(v: str) -> Optional[str]:
    if v == "" or re.fullmatch(r"[^:\s]+:\d+", v):
        return None
    return "expected HOST:PORT (process 0's address, the same for every process)"


def _dir_or_off(v: str) -> Optional[str]:
    if v in ("", "off"):
        return None
    if os.path.exists(v) and not os.path.isdir(v):
        return "is a file (expected a directory or 'off')"
    return None


OPTIONS = [
    Opt("dtype", "auto", "enum", "Compute (activation) dtype. auto: float32 on CPU whatever the checkpoint declares "
        "(XLA:CPU has no fast bf16 arithmetic; the native kernels keep bf16 weights in bf16 and compute in f32), "
        "the checkpoint's declared dtype elsewhere. The stats line prints what was picked.",
        ("auto", "float32", "bfloat16"), main=True),
    Opt("kv_cache_dtype", "auto", "enum", "Storage dtype of the K/V cache (MLA: the latent, rope and indexer keys). "
        "auto: float16 where the compute dtype is float32 (half the memory of a float32 cache, as llama.cpp's "
        "default f16 cache; each value is widened to f32 exactly where attention reads it); else the compute dtype. "
        "float32: the cache as transformers keeps it at float32 (the golden tests' bitwise parity).",
        ("auto", "float32", "float16", "bfloat16"), main=True),
    Opt("kernels", "auto", "enum", "Expert (and quantized dense) matrix products and decode attention: native (C++ kernels through jax.ffi, "
        "built on first use with the machine's C++ compiler into the per-user cache; int8 activations x int4/int8 "
        "weights with AVX-512 VNNI where present), xla (jnp code, no compiler needed), auto (native if it builds, "
        "else xla with a warning).", ("auto", "native", "xla")),
    Opt("dense_format", "native", "enum", "Storage format of the dense (non-expert) matrices at run time: native (as "
        "stored: the checkpoint's dtype, or the container's --dense_format), f32, bf16, int8_row, int4_g64 "
        "(quantized at load; the lm_head stays int8 for int4 formats). Quantized dense weights need the native "
        "kernels to be fast. Not given: as stored, unless the stored float weights leave the experts no room in the "
        "RAM budget (then int8_row, else int4_g64, said in one line).", ("native", "f32", "bf16", "int8_row",
                                                                          "int4_g64")),
    Opt("max_seq_len", 0, "int", "Context limit and KV-cache capacity per sequence in tokens (0: the model's "
        "max_position_embeddings; the cache grows with the requests). It may only lower the model's limit: RoPE is "
        "applied as the checkpoint defines it, without extension.", lo=0),
    Opt("reserve_tokens", 0, "int", "KV-cache positions per row the RAM plan reserves at load (0: min(the context "
        "limit, 4096), lowered down to 256 when memory is short; glm-jax passes its prompt + --max_new_tokens). The "
        "cache itself grows with the requests either way.", lo=0),
    Opt("max_batch", 1, "int", "Rows of the continuous-batching scheduler: sequences decoded together, each with its "
        "own KV rows (glm-jax-serve: 8; where the RAM plan would give 8 rows fewer than 1024 KV positions each and "
        "they could not grow to that, fewer rows of 1024, unless --max_batch is given). Decode runs at the width of the running rows (1, 2, 4, ...) with "
        "native kernels, else at this one; either way a sequence's output does not depend on the others; the "
        "expert store sizes its working set for this many rows.", lo=1, hi=256),
    Opt("prefill_chunk", 512, "int", "Prompt tokens per prefill forward: longer prompts are prefilled in chunks, "
        "interleaved with the other rows' decode steps.", lo=16, hi=1 << 20),
    Opt("dispatch_ms", 50.0, "float", "Plain resident decode runs several steps per dispatch of one compiled loop; "
        "where the host cannot read from inside it (--stream_interval=0, or no native kernels for a request "
        "nobody streams), it runs as many as fit in this many milliseconds (from the measured step time, 1 to 32 "
        "steps): that bounds how long tokens wait to be printed or sent and how long a cancelled request keeps its "
        "row; 0: one step per dispatch.", lo=0.0, hi=60000.0),
    Opt("stream_interval", 1, "int", "Plain resident decode hands each streamed row's tokens to its stream "
        "(printed, or sent as one server-sent event) every this many tokens from inside the running dispatch (the "
        "compiled loop, up to 32 steps, hands them to the host without waiting for it; a host that falls behind "
        "gets several at once; a cancel or stop string stops its row at the loop's next step, a waiting request "
        "ends it); 0: only between dispatches (--dispatch_ms).", lo=0, hi=1024),
    Opt("prefix_cache", True, "bool", "Reuse KV the scheduler still holds: a request whose prompt starts with the "
        "tokens of a finished request's row (its prompt and output) is admitted into that row and prefills only the "
        "rest (no extra memory: the rows are the cache, the least recently used one is taken first)."),
    Opt("prefix_store_mb", 256.0, "float", "Host RAM in MB for the K/V of sequences the rows no longer hold (the "
        "prefix cache's second level, as llama-server's --cache-ram): before a row is rewritten, what it held is "
        "copied there; a later prompt that starts with a saved sequence gets that prefix's K/V back and prefills "
        "only the rest. Least recently used first out; 0: off. A store-backed model (experts streamed under "
        "--ram_gb) keeps it off unless this is given, and then counts it in the RAM budget.", lo=0.0, hi=1 << 20),
    Opt("fetch", "auto", "enum", "How routed experts reach the MoE seam: resident (all in memory, one jit per token), "
        "loop (Python layer loop calling the expert store between jitted dense functions), callback (the store is "
        "called from inside one compiled step via io_callback, copying the union into a compact buffer), fused (decode "
        "and verify as one compiled program over the store's slot arenas, the store called only for a layer with a "
        "miss; the multi-step decode loop runs it too; prefills and --overlap the loop's way; bitwise loop's output). "
        "auto: resident for plain HF dirs, and for containers whose experts all fit the RAM budget (all loaded at "
        "start); otherwise fused (its decode runs without a host call while every expert it meets is cached), or "
        "loop where fused's compiled programs would cost the expert cache over 15% of its slots, on a mesh, "
        "or where the store's banks are copies.", ("auto", "resident", "loop", "callback", "fused"), main=True),
    Opt("expert_format", "native", "str", "Storage format of resident experts: native (checkpoint dtype), f32, bf16, "
        "int8_row, int4_row, int4_g<N> (N even, e.g. int4_g64).", check=_expert_format),
    Opt("colibri_env", False, "bool", "Also read the original engine's environment variables (CAP, RAM_GB, TOPP, "
        "MTP, PIN, ... listed as [env alias: ...] by --helpfull) as aliases of these flags. Off by default: a shell "
        "variable of the same name changes nothing. A flag given on the command line still wins."),
    Opt("cache_cap", 0, "int", "Expert-store cache capacity in experts per layer (0: size from --ram_gb).",
        env=("CAP",), lo=0, main=True),
    Opt("ram_gb", 0.0, "float", "RAM budget in GB of the whole process's private memory (RssAnon + RssShmem): dense + KV + expert cache + buffers (0: what is in use + 0.8 x "
        "MemAvailable, at most 0.9 x the memory cgroup's limit; above that limit: refused).",
        env=("RAM_GB",), lo=0.0, main=True),
    Opt("direct_io", False, "bool", "Read experts with O_DIRECT (bypass the page cache). Not given: on when the "
        "experts do not all fit the RAM budget (the page cache would hold a second copy inside the same limit), "
        "where the file system supports it.", env=("DIRECT",)),
    Opt("io_threads", 4, "int", "Parallel expert reads.", env=("PIPE_WORKERS",), lo=1, hi=256),
    Opt("verify_reads", "first", "enum", "Checksums of the expert records read from a container: first (each record's "
        "crc32 checked at its first read in the process: a record changed on disk after that is used as it is), "
        "always (at every read: a record changed under a running server is refused; one crc32 pass over every byte "
        "read, in the reading thread), off (never: a damaged file gives wrong numbers, not an error).",
        ("first", "always", "off")),
    Opt("overlap", True, "bool", "The loop's layers (fetch=loop; fused programs have no host step between layers): "
        "compute the layer's resident (hit) experts and the shared expert while its misses are read (decode-sized "
        "forwards; bitwise the same output). Decode 1.07-1.14x in the GLM-4.5-Air slice's 0.3x box "
        "(docs/real-scale.md).", env=("PIPE",)),
    Opt("read_chunk_mb", 1.0, "float", "Where a fetch misses fewer experts than --io_threads, split each expert "
        "read into a multiple of io_threads near-equal byte ranges of at most this many MB, so a layer's few large "
        "misses keep every I/O thread busy to the end; with as many misses as threads or more, each is one read "
        "(0: always one read per expert).", lo=0.0),
    Opt("prefetch", False, "bool", "Router-lookahead prefetch: apply layer L+1's router to layer L's state and load "
        "its predicted experts into free cache slots in the background while layer L computes (recall and "
        "prefetch_hits / prefetch_unused are reported).", env=("PILOT",)),
    Opt("pin", "", "str", "Pinned hot set: 'auto' (this model's usage history in --state_dir) or a usage file path.",
        env=("PIN",), check=_pin),
    Opt("pin_gb", 0.0, "float", "RAM for the pinned hot set in GB.", env=("PIN_GB",), lo=0.0),
    Opt("cache_policy", "lfu", "enum", "Expert cache eviction policy: lfu (use counts decayed with a half-life of 64 "
        "layer calls, ties by recency; the default: a higher hit rate than lru at every cache size in the replays "
        "and low-RAM runs of docs/benchmarks.md) or lru.", ("lru", "lfu"),
        env=("COLI_POLICY_CACHE",)),
    Opt("sim_disk_gbps", 0.0, "float", "Benchmark aid: after each expert read, also wait as if every loaded expert "
        "were --sim_expert_mb MB on a disk of this bandwidth (reported as sim_io_s; bytes_read stays real). 0 = off.",
        lo=0.0),
    Opt("sim_expert_mb", 19.0, "float", "Simulated expert size for --sim_disk_gbps (GLM-5.2 int4: ~19 MB).",
        lo=0.0, lo_open=True),
    Opt("route_trace", "", "str", "Append the routing of every streamed forward to this jsonl file (one forward per "
        "line: [[layer, [expert ids]], ...]); tools/bench/cache_sim.py replays it.", env=("ROUTE_TRACE",),
        check=_writable_file),
    Opt("expert_topp", 1.0, "float", "TOPP: per position keep the shortest prefix of experts (by gate weight) whose "
        "cumulative weight >= p x total; 1.0 = off. Lossy.", env=("TOPP",), lo=0.0, hi=1.0, lo_open=True, main=True),
    Opt("expert_budget", 0, "int", "EXPERT_BUDGET=N: cap distinct experts per layer (miss-aware); 0 = off. Lossy.",
        env=("EXPERT_BUDGET",), lo=0, main=True),
    Opt("budget_scope", "union", "enum", "union: cap the batch union (the seed); position: cap each position on its "
        "own (batch-invariant).", ("union", "position")),
    Opt("budget_residency", "cache", "enum", "What counts as a hit for the budget: cache (live cache + pinned), "
        "pinned (static pinned set), none (pure function of routing).", ("cache", "pinned", "none")),
    Opt("budget_max_positions", 4, "int", "Apply the budget only to forwards with at most this many real positions "
        "(decode and MTP verify; never prefill). 0 = always.", lo=0),
    Opt("cache_route", "off", "enum", "CACHE_ROUTE: prefer resident experts. max_rank (keep the true top-J, fill the "
        "rest with resident experts within the top-M) or prior (add lambda to resident scores). Lossy.",
        ("off", "max_rank", "prior"), env=("CACHE_ROUTE",)),
    Opt("route_j", 2, "int", "CACHE_ROUTE max_rank: true top-J always kept.", env=("ROUTE_J",), lo=1),
    Opt("route_m", 12, "int", "CACHE_ROUTE max_rank: substitution window top-M.", env=("ROUTE_M",), lo=1),
    Opt("route_alpha", 1.0, "float", "CACHE_ROUTE max_rank: weight multiplier of substitutes.", env=("ROUTE_ALPHA",),
        lo=0.0, lo_open=True),
    Opt("route_lambda", 0.1, "float", "CACHE_ROUTE prior: score bonus of resident experts.", env=("ROUTE_LAMBDA",),
        lo=0.0),
    Opt("plugins", (), "plugins", "User routing plugins (Python API: a list of RoutingState -> RoutingState "
        "callables, glm_jax_plugins.Plugin objects, 'module:factory' strings or ('module:factory', {kwargs}) pairs; "
        "flags: --plugin / --plugin_args). Applied in the given order after cache_route and topp, before "
        "expert_budget. Lossy."),
    Opt("mtp", False, "bool", "Speculative decoding with the model's MTP layer when it has one (--mtp; off by "
        "default: on the shipped model it decoded 3.3x slower than plain decode on CPU, 529 vs 1756 tok/s with "
        "44% acceptance, docs/flags.md). Greedy output is identical either way.", env=("MTP",), main=True),
    Opt("draft", -1, "int", "Draft tokens per step (-1: 3 with --mtp and an MTP layer, else 0).",
        env=("DRAFT",), lo=-1, hi=63, main=True),
    Opt("draft_source", "auto", "enum", "Where drafts come from: auto (mtp if present), mtp, ngram (prompt lookup).",
        ("auto", "mtp", "ngram")),
    Opt("mtp_guard_pct", 70.0, "float", "Pause drafting when acceptance over the window drops below this %.",
        env=("COLI_MTP_GUARD_PCT",), lo=0.0, hi=100.0),
    Opt("mtp_guard_window", 24, "int", "Proposals in the acceptance guard's window.", env=("COLI_MTP_GUARD_WINDOW",),
        lo=1, hi=1 << 20),
    Opt("mesh", "", "str", "Device mesh, e.g. expert:4,model:2: routed experts sharded over the expert axis (each "
        "device holds E/n of every MoE layer's experts), attention heads and dense MLPs tensor-parallel over the "
        "model axis (dense weights then run the XLA path), the KV cache split by heads. An axis not given takes the "
        "devices left; default: every device (of every process) on expert. One device: the single-device engine.",
        check=_mesh, main=True),
    Opt("expert_comm", "auto", "enum", "How tokens reach their experts on a mesh: psum (every device computes its own "
        "experts for every token, one all-reduce), all_to_all (tokens split over the expert axis, sent to their "
        "experts' devices and back), auto = psum (measured faster at decode and prefill, README).",
        ("auto", "psum", "all_to_all")),
    Opt("coordinator", "", "str", "Multi-process: HOST:PORT of process 0 (jax.distributed; every process passes the "
        "same value). Each process loads only its devices' expert shards; process 0 tokenizes and prints.",
        check=_coordinator),
    Opt("num_processes", 1, "int", "Multi-process: number of processes (with --coordinator).", lo=1, hi=1 << 16),
    Opt("process_id", 0, "int", "Multi-process: this process's index in [0, --num_processes).", lo=0, hi=1 << 16),
    Opt("state_dir", "", "str", "Per-user runtime state (the experts' usage history behind --pin=auto), one file per "
        "model. Default: $XDG_STATE_HOME/glm-jax (~/.local/state/glm-jax); 'off': keep no history. Never the model "
        "directory or the installed package.", check=_dir_or_off, main=True),
    Opt("compile_cache", "", "str", "Persistent XLA compilation cache, so a second start compiles nothing. Default: "
        "$XDG_CACHE_HOME/glm-jax/xla (~/.cache/glm-jax/xla); a directory; 'off'.", check=_dir_or_off, main=True),
]

BY_NAME = {o.name: o for o in OPTIONS}

# glm-jax-serve's request limits and --warmup: flags of that command only (not engine options), checked like the table above
SERVE_OPTIONS = [
    Opt("max_body_mb", 8.0, "float", "Largest request body in MB; a larger one is refused with HTTP 413 before it is "
        "read (its Content-Length, or as soon as the bytes received pass the limit).", lo=0.0, hi=4096.0,
        lo_open=True),
    Opt("read_timeout_s", 30.0, "float", "A connection whose request (headers and body) has not fully arrived this "
        "many seconds after it opened (or after its previous response) is closed; idle keep-alive connections are "
        "closed after --keep_alive_s.", lo=0.0, hi=86400.0, lo_open=True),
    Opt("keep_alive_s", 5.0, "float", "Seconds an idle keep-alive connection stays open.", lo=0.0, hi=3600.0,
        lo_open=True),
    Opt("warmup", True, "bool", "At start (listening at once; /health answers 503 'loading' until it is done), compile "
        "the programs the first requests need (a 72-token "
        "prefill, decode at every batch width up to --max_batch, a prefix-cache hit, the other prefill buckets up to "
        "--prefill_chunk), so no client waits for a "
        "compile. With --compile_cache a later start loads most of them from it (--fetch=callback / fused "
        "programs hold a host callback and compile at every start)."),
    Opt("prefix_cache_scope", "key", "enum", "Whose finished requests' K/V a request may reuse (the prefix cache): "
        "key = requests made with the same API key (and the same cache_salt field, if sent); global = any request "
        "(between keys, cached_tokens and the time to the first token then tell one client how much of another's "
        "prompt it guessed).", choices=("key", "global")),
]
SERVE_BY_NAME = {o.name: o for o in SERVE_OPTIONS}

# glm-jax-eval's verdict: the config passes when every measure is within its threshold of the reference
EVAL_OPTIONS = [
    Opt("max_ppl_increase", 0.05, "float", "glm-jax-eval's verdict: the most the config's perplexity may exceed the "
        "reference's, as a fraction (0.05: 5%).", lo=0.0, hi=100.0),
    Opt("max_kl", 0.05, "float", "glm-jax-eval's verdict: the largest KL(reference || config) per token, in nats.",
        lo=0.0, hi=100.0),
    Opt("min_top1", 0.9, "float", "glm-jax-eval's verdict: the least top-1 agreement with the reference.", lo=0.0,
        hi=1.0),
    Opt("max_mc_drop", 0.03, "float", "glm-jax-eval's verdict: the most the next-line multiple-choice acc_norm may "
        "fall below the reference's (--items > 0).", lo=0.0, hi=1.0),
]
EVAL_BY_NAME = {o.name: o for o in EVAL_OPTIONS}


def _range_text(o: Opt) -> str:
    what = "an integer" if o.kind == "int" else "a number"

    def n(v):            # an integer range in integers ([16, 1048576], not [16, 1.04858e+06])
        return str(int(v)) if o.kind == "int" else f"{v:g}"
    if o.lo is not None and o.hi is not None:
        return f"{what} in {'(' if o.lo_open else '['}{n(o.lo)}, {n(o.hi)}]"
    if o.lo is not None:
        return f"{what} {'>' if o.lo_open else '>='} {n(o.lo)}"
    if o.hi is not None:
        return f"{what} <= {n(o.hi)}"
    return what


def check_value(o: Opt, v: Any, where: str):
    """Parse and range-check one value of option ``o``; ``where`` names its source (flag / env / keyword)."""
    if o.kind == "plugins":
        return _parse_plugins(v, where)
    def bad(msg=None, parsed=None):
        shown = repr(v) if not isinstance(v, str) or v.strip() != v or not v or " " in v else v
        if parsed is not None:        # a number out of range: shown as parsed (flag, alias and keyword alike)
            shown = f"{parsed:g}" if isinstance(parsed, float) else str(parsed)
        if msg:
            return OptionError(f"{where}: invalid value {shown}: {msg}")
        exp = (f"one of {', '.join(o.choices)}" if o.kind == "enum"
               else _range_text(o) if o.kind in ("int", "float")
               else "true/false (1/0, yes/no, on/off)" if o.kind == "bool" else "a string")
        return OptionError(f"{where}: invalid value {shown} (expected {exp})")

    if o.kind == "int":
        if isinstance(v, bool):
            raise bad()
        if isinstance(v, str):
            try:
                x = int(v.strip())
            except ValueError:
                raise bad() from None
        elif isinstance(v, int) or (hasattr(v, "dtype") and getattr(v.dtype, "kind", "") in "iu"):
            x = int(v)
        else:                                   # 1.7 is not silently 1
            raise bad()
    elif o.kind == "float":
        if isinstance(v, bool):
            raise bad()
        try:
            x = float(v.strip() if isinstance(v, str) else v)
        except (TypeError, ValueError):
            raise bad() from None
        if not math.isfinite(x):
            raise bad()
    elif o.kind == "bool":
        if isinstance(v, str):
            s = v.strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off", ""):
                return False
            raise bad()
        if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
            return bool(v)
        raise bad()
    elif o.kind == "enum":
        if not isinstance(v, str) or v not in o.choices:
            raise bad()
        return v
    else:
        if not isinstance(v, str):
            raise bad()
        if o.check is not None:
            msg = o.check(v)
            if msg:
                raise bad(msg)
        return v
    if not math.isfinite(x):
        raise bad()
    if o.lo is not None and (x < o.lo or (o.lo_open and x == o.lo)):
        raise bad(parsed=x)
    if o.hi is not None and x > o.hi:
        raise bad(parsed=x)
    return x


class Options(dict):
    """Resolved option values (a plain dict to every consumer) plus where each came from, for messages."""

    def __init__(self, values: dict, sources: dict, labels: Optional[dict] = None):
        super().__init__(values)
        self.sources = dict(sources)
        self.labels = dict(labels or {})
        self.auto = set()           # values a command chose where the user gave none (set_auto)

    def set_auto(self, name: str, value):
        """A value the command chooses where the user gave none (glm-jax-serve's --max_batch): what the memory plan
        may lower (``is_auto``), unlike a value the user set."""
        self[name] = value
        self.auto.add(name)

    def is_auto(self, name: str) -> bool:
        return name in self.auto and name not in self.sources

    def where(self, name: str, default: str = "") -> str:
        """'flag --x' | 'environment variable X (alias of --x)' | "option 'x'" | ``default`` (not set)."""
        return self.sources.get(name, default)

    def label(self, name: str) -> str:
        """How the user spelled the setting, for 'LABEL=value' in messages: '--x' (flag, or not set), 'X' (the
        environment alias), 'x' (a keyword of Engine.load)."""
        return self.labels.get(name, f"--{name}")


def _label(kind: str, name: str) -> str:
    return f"flag --{name}" if kind == "flag" else f"option '{name}'"


def resolve(explicit: Optional[dict] = None, environ=None, kind: str = "keyword") -> Options:
    """Defaults <- environment aliases (only with ``colibri_env=True`` / ``--colibri_env``) <- explicit values (flags
    or keywords).  Unknown names are errors; an explicit value wins over the environment without the alias being
    parsed (a garbage alias cannot abort it)."""
    environ = os.environ if environ is None else environ
    explicit = dict(explicit or {})
    for k in explicit:
        if k not in BY_NAME:
            raise OptionError(f"option '{k}': unknown (known: {', '.join(sorted(BY_NAME))})")
    out, src, lab = {}, {}, {}
    use_env = "colibri_env" in explicit and check_value(BY_NAME["colibri_env"], explicit["colibri_env"],
                                                        _label(kind, "colibri_env")) is True
    for o in OPTIONS:
        if o.name in explicit:
            where = _label(kind, o.name)
            out[o.name] = check_value(o, explicit[o.name], where)
            src[o.name] = where
            lab[o.name] = f"--{o.name}" if kind == "flag" else o.name
            continue
        out[o.name] = o.default
        for e in (o.env if use_env else ()):
            if e in environ and environ[e] != "":
                where = f"environment variable {e} (alias of --{o.name})"
                out[o.name] = check_value(o, environ[e], where)
                src[o.name] = where
                lab[o.name] = e
                break
    return Options(out, src, lab)


# ----------------------------------------------------------------------------- user routing plugins
@dataclasses.dataclass(frozen=True)
class PluginSpec:
    """A plugin named by ``module:factory`` (imported from the user's PYTHONPATH) and its keyword arguments."""
    spec: str
    kwargs: tuple = ()            # sorted (key, value) pairs
    origin: str = "option 'plugins'"

    @property
    def name(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        return f"{self.spec}({args})" if args else self.spec


_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_ARG_SPLIT = re.compile(r",(?=\s*[A-Za-z_]\w*\s*=)")


def parse_spec(spec: str, kwargs=None, origin: str = "option 'plugins'") -> PluginSpec:
    spec = str(spec).strip()
    if not _SPEC.match(spec):
        raise OptionError(f"{origin}: expected module:factory (e.g. glm_jax_plugins.weight_floor:weight_floor), "
                          f"got {spec!r}")
    kw = dict(kwargs or {})
    if not all(isinstance(k, str) and k.isidentifier() for k in kw):
        raise OptionError(f"{origin}: plugin arguments must be keyword names, got {sorted(map(str, kw))}")
    return PluginSpec(spec, tuple(sorted(kw.items())), origin)


def parse_plugin_args(text: str, origin: str = "flag --plugin_args") -> dict:
    """'key=value,key=value' -> dict.  Values are Python literals where they parse as one (0.1, 2, True, None,
    "0,0,2,2" -> a tuple), else strings; a comma separates pairs only when a ``key=`` follows it."""
    out = {}
    text = (text or "").strip()
    if not text:
        return out
    for part in _ARG_SPLIT.split(text):
        k, eq, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or not k.isidentifier():
            raise OptionError(f"{origin}: expected key=value[,key=value...], got {part.strip()!r} in {text!r}")
        if v.lower() in ("true", "false"):
            out[k] = v.lower() == "true"
            continue
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def parse_plugin_flags(specs, args) -> tuple:
    """``--plugin`` values and ``--plugin_args`` values (the i-th --plugin_args belongs to the i-th --plugin; give
    none, or one per --plugin, '' for a plugin without arguments) -> PluginSpecs."""
    specs, args = list(specs or []), list(args or [])
    if args and not specs:
        raise OptionError("flag --plugin_args: given without --plugin")
    if args and len(args) != len(specs):
        raise OptionError(f"flag --plugin_args: given {len(args)} times for {len(specs)} --plugin flags (one per "
                          "--plugin, in the same order; '' for a plugin without arguments)")
    out = []
    for i, sp in enumerate(specs):
        kw = parse_plugin_args(args[i], f"flag --plugin_args={args[i]!r}") if args else {}
        out.append(parse_spec(sp, kw, f"flag --plugin={sp}"))
    return tuple(out)


def _parse_plugins(v, where: str) -> tuple:
    if v is None:
        return ()
    if isinstance(v, (str, PluginSpec)) or callable(v):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise OptionError(f"{where}: expected a list of plugins, got {type(v).__name__}")
    out = []
    for i, item in enumerate(v):
        if isinstance(item, PluginSpec) or (callable(item) and not isinstance(item, type)):
            out.append(item)
        elif isinstance(item, str):
            out.append(parse_spec(item, None, f"{where}[{i}]"))
        elif (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], dict)):
            out.append(parse_spec(item[0], item[1], f"{where}[{i}]"))
        else:
            raise OptionError(f"{where}[{i}]: expected a RoutingState -> RoutingState callable, 'module:factory' or "
                              f"('module:factory', {{kwargs}}), got {item!r}")
    return tuple(out)


def load_plugins(items) -> list:
    """Resolve the ``plugins`` option: [(callable, name)].  A spec is imported (``module:factory`` -> factory(**kw));
    an attribute that is already a glm_jax_plugins.Plugin is used as it is.  Errors name the flag / plugin."""
    out = []
    for item in items:
        if not isinstance(item, PluginSpec):
            out.append((item, getattr(item, "name", None) or getattr(item, "__name__", None) or repr(item)))
            continue
        where = item.origin
        mod_name, _, attr = item.spec.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:        # noqa: BLE001 - one line naming the flag
            raise PluginError(f"{where}: cannot import module {mod_name!r} ({type(e).__name__}: {e}); is it on "
                              "PYTHONPATH?") from None
        obj = mod
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise PluginError(f"{where}: module {mod_name!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        kw = dict(item.kwargs)
        if isinstance(obj, Plugin):
            if kw:
                raise PluginError(f"{where}: {attr} is a plugin, not a factory: it takes no --plugin_args")
            plugin = obj
        elif callable(obj):
            try:
                plugin = obj(**kw)
            except Exception as e:    # noqa: BLE001
                raise PluginError(f"{where}: {attr}(**{kw}) raised {type(e).__name__}: {e}") from None
        else:
            raise PluginError(f"{where}: {attr} is not callable")
        if not callable(plugin):
            raise PluginError(f"{where}: {attr}(...) returned {type(plugin).__name__}, not a RoutingState -> "
                              "RoutingState callable")
        name = getattr(plugin, "name", None)
        out.append((plugin, item.name if not name or getattr(plugin, "is_identity", False) else name))
    return out


def define_once(define, name: str, *args, **kw):
    """``define(name, ...)`` (an absl DEFINE_*) unless a flag of that name exists: commands that share a flag with the
    same meaning (--model, --output_json) can be imported into one process (tests run them in-process)."""
    from absl import flags

    if name not in flags.FLAGS:
        define(name, *args, **kw)


def one_line(e) -> str:
    """An error's text on one line (what every command prints after ``PROG: error:``)."""
    return " ".join(str(e).split())


HELP_ARGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")


def command_help(flag_values, head: list, names, tail: str) -> str:
    """A command's ``--help``: ``head`` lines, then each flag of ``names`` with its default and help, then ``tail``
    (the commands' own main flags first, then the table's main options)."""
    import textwrap

    out = list(head) + ["main flags:"]
    for n in names:
        fl = flag_values[n]
        default = repr(fl.default) if isinstance(fl.default, str) else fl.default
        out.append(f"  --{n}  (default: {default})")
        out += textwrap.wrap(fl.help, width=100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(out + ["", tail])


def main_flag_names(command_flags) -> list:
    """A command's own main flags, then the option table's main options not among them."""
    return list(command_flags) + [o.name for o in OPTIONS if o.main and o.name not in command_flags]


def parse_command_flags(flag_values, argv, prog: str, help_text):
    """absl flag parsing for a command: ``--help`` prints ``help_text()`` (exit 0), a bad flag is one
    ``PROG: error:`` line (exit 2)."""
    import sys

    from absl import flags

    if any(a in HELP_ARGS for a in argv[1:]):
        try:
            print(help_text(), flush=True)
        except BrokenPipeError:              # `--help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    try:
        return flag_values(argv)
    except flags.Error as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)


def define_flags(flags_module=None):
    """Define one absl flag per option (idempotent).  Ranges are checked by ``resolve`` (one error text for flags,
    aliases and keywords), not by absl."""
    from absl import flags

    F = flags_module or flags
    for o in OPTIONS:
        if o.kind == "plugins":
            if "plugin" not in F.FLAGS:
                F.DEFINE_multi_string("plugin", [], "A user routing plugin, module:factory (repeatable): factory("
                                      "**args) is imported from PYTHONPATH and must return a jittable RoutingState "
                                      "-> RoutingState callable (glm_jax_plugins.routing). Applied in the given "
                                      "order after --cache_route and --expert_topp, before --expert_budget. "
                                      "Example: --plugin=glm_jax_plugins.weight_floor:weight_floor.")
                F.DEFINE_multi_string("plugin_args", [], "key=value[,key=value...] arguments of the factory of "
                                      "the --plugin in the same position (repeat once per --plugin; '' for none). "
                                      "Values are Python literals (0.1, 2, True, 0,0,2,2 -> a tuple) or strings.")
            continue
        if o.name in F.FLAGS:
            continue
        h = o.help + (f" [env alias: {', '.join(o.env)}, read with --colibri_env]" if o.env else "")
        if o.kind in ("int", "float") and (o.lo is not None or o.hi is not None):
            h += f" [{_range_text(o)}]"
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


def define_serve_flags():
    """glm-jax-serve's own flags (SERVE_OPTIONS: request limits, --warmup; idempotent)."""
    from absl import flags

    for o in SERVE_OPTIONS:
        if o.name in flags.FLAGS:
            continue
        if o.kind == "bool":
            flags.DEFINE_boolean(o.name, o.default, o.help)
        elif o.kind == "enum":
            flags.DEFINE_enum(o.name, o.default, o.choices, o.help)
        else:
            flags.DEFINE_float(o.name, o.default, o.help + f" [{_range_text(o)}]")


def define_eval_flags():
    """glm-jax-eval's verdict thresholds (EVAL_OPTIONS; idempotent)."""
    from absl import flags

    for o in EVAL_OPTIONS:
        if o.name not in flags.FLAGS:
            flags.DEFINE_float(o.name, o.default, o.help + f" [{_range_text(o)}]")


def eval_from_flags() -> dict:
    """EVAL_OPTIONS' values from the parsed flags, range-checked (OptionError naming the flag)."""
    from absl import flags

    return {o.name: check_value(o, flags.FLAGS[o.name].value, f"flag --{o.name}") for o in EVAL_OPTIONS}


def serve_from_flags() -> dict:
    """SERVE_OPTIONS' values from the parsed flags, range-checked (OptionError naming the flag)."""
    from absl import flags

    return {o.name: check_value(o, flags.FLAGS[o.name].value, f"flag --{o.name}") for o in SERVE_OPTIONS}


def define_model_flag():
    """--model, shared by glm-jax and glm-jax-serve (both may be imported in one process)."""
    from absl import flags

    if "model" not in flags.FLAGS:
        flags.DEFINE_string("model", "", "Model directory: a Hugging Face checkpoint (config.json + safetensors) or a "
                            "container written by glm-jax-convert. Default: the embedded model shipped with glm-jax.")


def from_flags() -> Options:
    """Options from parsed absl flags: only flags given on the command line count as explicit (so env aliases apply
    to the others)."""
    from absl import flags

    F = flags.FLAGS
    explicit = {o.name: F[o.name].value for o in OPTIONS if o.kind != "plugins" and F[o.name].present}
    if F["plugin"].present or F["plugin_args"].present:
        explicit["plugins"] = parse_plugin_flags(F.plugin, F.plugin_args)
    return resolve(explicit, kind="flag")


# ----------------------------------------------------------------------------- helpers shared by the CLIs
def writable_problem(path: str) -> Optional[str]:
    """None if ``path`` can be written (fileio.write_output / append_output: created, replaced or written through),
    else what is wrong.  Creates nothing, and opens no FIFO or device (no hang on a FIFO without a reader)."""
    return fileio.output_problem(path)


def write_json_output(path: str, obj, flag: str = "--output_json"):
    """``obj`` as JSON into the user's ``path`` (fileio.write_output: a symlink, device or FIFO written through, a
    regular file replaced atomically); a failure is one OptionError line naming the flag."""
    try:
        fileio.write_output(path, json.dumps(obj, indent=1))
    except OSError as e:
        raise OptionError(f"{flag}={path}: cannot write ({e.strerror or e})") from None


def check_writable(path: str, where: str):
    msg = writable_problem(path)
    if msg:
        raise OptionError(f"{where}={path}: {msg}")
