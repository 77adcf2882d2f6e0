"""Engine options: one table shared by the absl flags of every command and by ``Engine.load(**options)``.

Each option has a flag of the same name, except ``plugins`` (user routing plugins), whose flags are ``--plugin``
(repeatable) and ``--plugin_args``: :func:`define_flags` defines them for every command that takes engine options
(glm-jax, glm-jax-eval, and glm-jax-serve when it exists), and :func:`from_flags` turns them into the ``plugins``
option.  The original engine's environment names (colibri: EXPERT_BUDGET, TOPP, MTP, ...) are accepted as aliases; an
explicitly given flag or keyword always wins over the environment.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
from typing import Any, Optional

from .config import GlmJaxError


class OptionError(GlmJaxError):
    pass


class PluginError(GlmJaxError):
    """A user routing plugin could not be loaded or broke the plugin contract (glm_jax_plugins.contract)."""


@dataclasses.dataclass(frozen=True)
class Opt:
    name: str
    default: Any
    kind: str            # "str" | "int" | "float" | "bool" | "enum"
    help: str
    choices: tuple = ()
    env: tuple = ()      # environment aliases (original engine's names)


OPTIONS = [
    Opt("dtype", "auto", "enum", "Compute dtype of the dense weights/activations (auto: float32 for f32 checkpoints "
        "and tiny models, bfloat16 otherwise).", ("auto", "float32", "bfloat16")),
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
    Opt("plugins", (), "plugins", "User routing plugins (Python API: a list of RoutingState -> RoutingState "
        "callables, glm_jax_plugins.Plugin objects, 'module:factory' strings or ('module:factory', {kwargs}) pairs; "
        "flags: --plugin / --plugin_args). Applied in the given order after cache_route and topp, before "
        "expert_budget. Lossy."),
    Opt("mtp", True, "bool", "Use the model's MTP layer for speculative decoding when it has one.", env=("MTP",)),
    Opt("draft", -1, "int", "Draft tokens per step (-1: 3 with an MTP layer or n-gram drafts, else 0).",
        env=("DRAFT",)),
    Opt("draft_source", "auto", "enum", "Where drafts come from: auto (mtp if present), mtp, ngram (prompt lookup).",
        ("auto", "mtp", "ngram")),
    Opt("mtp_guard_pct", 70.0, "float", "Pause drafting when acceptance over the window drops below this %.",
        env=("COLI_MTP_GUARD_PCT",)),
    Opt("mtp_guard_window", 24, "int", "Proposals in the acceptance guard's window.", env=("COLI_MTP_GUARD_WINDOW",)),
]

BY_NAME = {o.name: o for o in OPTIONS}


def _parse(o: Opt, v: Any, where: str):
    if o.kind == "plugins":
        return _parse_plugins(v, where)
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
    from glm_jax_plugins import Plugin

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


def define_flags(flags_module=None):
    """Define one absl flag per option (idempotent); the ``plugins`` option becomes --plugin / --plugin_args."""
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
    explicit = {o.name: F[o.name].value for o in OPTIONS if o.kind != "plugins" and F[o.name].present}
    if F["plugin"].present or F["plugin_args"].present:
        explicit["plugins"] = parse_plugin_flags(F.plugin, F.plugin_args)
    return resolve(explicit)
