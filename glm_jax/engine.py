"""The Python API (a contract: scripts outside the repo call it).

    engine = glm_jax.Engine.load(path, **options)      # options mirror the CLI flags (glm_jax/options.py)
    engine.logits(token_ids) -> np.ndarray [T, vocab]   # full forward, no cache
    out = engine.generate("To be", max_new_tokens=32, temperature=0.0)
    out.tokens, out.text, out.stats                      # stats: prefill_tokens, prefill_s, decode_tokens, decode_tok_s...
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import model as M
from . import options as O
from .config import GlmJaxError, ModelConfig, load_config

_COMPILE_S = [0.0]


def _on_event(name, secs, **kw):
    if name.startswith("/jax/core/compile/"):
        _COMPILE_S[0] += secs


jax.monitoring.register_event_duration_secs_listener(_on_event)

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


def default_model_path() -> str:
    return DEFAULT_MODEL_DIR


@dataclasses.dataclass
class GenerationResult:
    tokens: list
    text: str
    stats: dict
    prompt_tokens: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "stats": self.stats, "prompt_tokens": self.prompt_tokens}


def _bucket(n: int, minimum: int = 16) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def _round_up(n: int, m: int) -> int:
    return ((n + m - 1) // m) * m


class Tokenizer:
    """tokenizer.json via the `tokenizers` library, plus GLM chat formatting."""

    CHAT_TOKENS = ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTok

        self.path = path
        try:
            self.tok = HFTok.from_file(path)
        except Exception as e:
            raise GlmJaxError(f"{path}: cannot load tokenizer ({e})") from None

    def encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_id(self, s: str) -> Optional[int]:
        return self.tok.token_to_id(s)

    @property
    def supports_chat(self) -> bool:
        return all(self.token_id(t) is not None for t in self.CHAT_TOKENS)

    def chat_ids(self, prompt: str) -> list:
        if not self.supports_chat:
            raise GlmJaxError(f"{self.path}: --chat needs the tokens {', '.join(self.CHAT_TOKENS)} in the tokenizer")
        g, sop, u, a = (self.token_id(t) for t in self.CHAT_TOKENS)
        return [g, sop, u] + self.encode("\n" + prompt) + [a] + self.encode("\n")


class Engine:
    """A loaded model: config, params (dense resident; experts resident or behind an expert store), tokenizer."""

    def __init__(self, path: str, cfg: ModelConfig, params: dict, opts: dict, tokenizer: Optional[Tokenizer],
                 store=None):
        self.path = path
        self.cfg = cfg
        # committed to the device, like the store's banks and the cache: jit keys its compiled programs on whether
        # each argument is committed, and a mix that changes between calls compiles the same program again
        self.device = jax.devices()[0]
        self.params = jax.device_put(params, self.device)
        self.opts = opts
        self.tokenizer = tokenizer
        self.store = store
        self.dtype = params["embed"].dtype
        self.moe_layers = cfg.moe_layers
        self._cache = None
        self._cache_len = 0
        self.plugin, self.plugin_names = _build_plugin(opts)
        self.lossy = self.plugin is not None
        if self.plugin_names:
            _preflight(self.plugin, cfg)
        self._jits = {}
        self._route_acc = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: Optional[str] = None, **options) -> "Engine":
        opts = O.resolve(options)
        path = path or default_model_path()
        if not os.path.isdir(path):
            raise GlmJaxError(f"{path}: model directory not found")
        cfg = load_config(path)
        from . import weights as W

        container = os.path.exists(os.path.join(path, "manifest.json"))
        fetch = opts["fetch"]
        if fetch == "auto":
            fetch = "loop" if container else "resident"
        opts["fetch"] = fetch
        dtype = _pick_dtype(opts["dtype"], path, cfg)
        store = None
        if fetch == "resident" and not container:
            params = W.load_params(path, cfg, dtype=dtype, expert_fmt=opts["expert_format"])
        else:
            from . import store as S

            if container:
                params = W.load_dense_params(path, cfg, dtype=dtype)
            else:
                params = W.load_params(path, cfg, dtype=dtype, expert_fmt=None)
            store = S.ExpertStore.open(path, cfg, cache_cap=opts["cache_cap"] or None, ram_gb=opts["ram_gb"] or None,
                                       direct_io=opts["direct_io"], io_threads=opts["io_threads"],
                                       read_chunk_mb=opts["read_chunk_mb"],
                                       pin=opts["pin"] or None, pin_gb=opts["pin_gb"], policy=opts["cache_policy"],
                                       dense_bytes=_tree_bytes(params),
                                       # a prefill can route to every expert of a layer: the working set may be E
                                       # (anonymous-mmap slots cost RAM only while they hold a forward's union)
                                       max_working_set=cfg.n_routed_experts)
            store.sim_disk_gbps, store.sim_expert_mb = opts["sim_disk_gbps"], opts["sim_expert_mb"]
            if fetch == "resident":
                raise GlmJaxError(f"{path}: --fetch=resident needs a plain HF checkpoint (this is a converted "
                                  "container); use --fetch=loop or --fetch=callback")
        tok_path = os.path.join(path, "tokenizer.json")
        tok = Tokenizer(tok_path) if os.path.exists(tok_path) else None
        return cls(path, cfg, params, opts, tok, store)

    # ------------------------------------------------------------------ jitted pieces
    def _jit(self, name, fn, **kw):
        f = self._jits.get(name)
        if f is None:
            f = self._jits[name] = jax.jit(fn, **kw)
        return f

    def _step_resident(self):
        cfg, plugin = self.cfg, self.plugin or M.identity_plugin
        want_stats = self.plugin is not None

        def f(params, cache, tokens, start, lengths, resident, moe_rows=None):
            logits, hidden, cache, routing = M.step(cfg, params, cache, tokens, start, lengths, resident, plugin,
                                                    moe_rows)
            return logits, hidden, cache, _routing_summary(routing, want_stats)

        return self._jit("step", f, donate_argnums=(1,), static_argnames=("moe_rows",))

    # ------------------------------------------------------------------ core forward
    def _ensure_cache(self, batch: int, need: int):
        cap = self.opts["max_seq_len"] or _round_up(max(need, 64), 256)
        if need > cap:
            raise GlmJaxError(f"option 'max_seq_len': {cap} tokens is too small for this request ({need} needed)")
        if self._cache is None or self._cache_len < cap or self._cache_batch != batch:
            self._cache = jax.device_put(M.init_cache(self.cfg, batch, cap, self.dtype,
                                                      with_mtp=self.params.get("mtp") is not None), self.device)
            self._cache_len = cap
            self._cache_batch = batch
        return self._cache

    def resident_for(self, layer: int) -> np.ndarray:
        """bool [E]: what the routing plugins see as resident in ``layer`` (--budget_residency: the live cache +
        pins, the pins only, or nothing; nothing without a store)."""
        mode = self.opts["budget_residency"]
        if self.store is None or mode == "none":
            return np.zeros(self.cfg.n_routed_experts, bool)
        return self.store.pinned_mask(layer) if mode == "pinned" else self.store.resident_mask(layer)

    @property
    def residency_is_static(self) -> bool:
        """True when what the plugins see as ``resident`` cannot change during a run (no store, or
        --budget_residency none / pinned): a plugin that reads it is then still a function of the routing alone."""
        return self.store is None or self.opts["budget_residency"] != "cache"

    def _resident_masks(self):
        return jnp.asarray(np.stack([self.resident_for(l) for l in self.moe_layers]).reshape(
            len(self.moe_layers), self.cfg.n_routed_experts))

    def forward(self, tokens: np.ndarray, start: np.ndarray, lengths: np.ndarray):
        """Run tokens [B, T] at positions start[b] on the engine's cache.  Returns (logits, hidden, summary)."""
        # a short padded forward (decode / MTP verify at a fixed width, speculative.py) runs the routed experts on
        # its real rows only
        B, T = np.shape(tokens)
        moe_rows = int(np.max(lengths)) if B == 1 and T <= 16 and int(np.max(lengths)) < T else None
        tokens = jnp.asarray(tokens, jnp.int32)
        start = jnp.asarray(start, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        if self.opts["fetch"] == "resident":
            logits, hidden, self._cache, summ = self._step_resident()(
                self.params, self._cache, tokens, start, lengths, self._resident_masks(), moe_rows=moe_rows)
            self._accumulate(summ)
            return logits, hidden
        from .streaming import stream_step

        logits, hidden, self._cache = stream_step(self, tokens, start, lengths)
        return logits, hidden

    def _check_routing(self, summ):
        """Raise the contract violation a forward's routing summary reports (user plugins' in-jit value checks,
        glm_jax_plugins.contract), if any; removes those keys from ``summ``."""
        if not summ or "violation" not in summ:
            return
        code, layer = int(summ.pop("violation")), int(summ.pop("violation_layer"))
        if code:
            from glm_jax_plugins import contract

            i, flags = contract.decode(code)
            name = self.plugin_names[i] if 0 <= i < len(self.plugin_names) else f"#{i}"
            raise O.PluginError(f"routing plugin '{name}' broke the contract at layer {layer}: "
                                f"{contract.describe(flags)}")

    def _accumulate(self, summ):
        self._check_routing(summ)
        if summ:
            acc = self._route_acc
            for k, v in summ.items():
                acc[k] = acc.get(k, 0.0) + float(v)

    # ------------------------------------------------------------------ public API
    def logits(self, token_ids) -> np.ndarray:
        """Full forward over token_ids (a list / 1-D array -> [T, V]; a list of lists -> list of [T_i, V])."""
        if len(token_ids) and isinstance(token_ids[0], (list, tuple, np.ndarray)):
            return self.batch_logits(token_ids)
        return self.batch_logits([token_ids])[0]

    def batch_logits(self, seqs: Sequence[Sequence[int]]) -> list:
        """Teacher-forced logits for a batch of sequences (right-padded, one forward)."""
        seqs = [list(map(int, s)) for s in seqs]
        for s in seqs:
            if not s:
                raise GlmJaxError("logits: empty token sequence")
            bad = [t for t in s if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise GlmJaxError(f"logits: token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        B = len(seqs)
        T = _bucket(max(len(s) for s in seqs))
        self._route_acc = {}
        self._ensure_cache(B, T)
        toks = np.zeros((B, T), np.int32)
        for i, s in enumerate(seqs):
            toks[i, : len(s)] = s
        logits, _ = self.forward(toks, np.zeros(B, np.int32), np.array([len(s) for s in seqs], np.int32))
        logits = np.asarray(logits)
        return [logits[i, : len(s)] for i, s in enumerate(seqs)]

    def encode(self, text: str, chat: bool = False) -> list:
        if self.tokenizer is None:
            raise GlmJaxError(f"{self.path}: no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.chat_ids(text) if chat else self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def generate(self, prompt_or_ids: Union[str, Sequence[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = False,
                 stop_on_eos: bool = True) -> GenerationResult:
        from .generate import generate

        return generate(self, prompt_or_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, chat=chat, stop_on_eos=stop_on_eos)

    @property
    def compile_s(self) -> float:
        """Seconds spent tracing + compiling jitted functions in this process (all engines)."""
        return _COMPILE_S[0]

    def close(self):
        if self.store is not None:
            self.store.close()


# ----------------------------------------------------------------------------- helpers
def _pick_dtype(name: str, path: str, cfg: ModelConfig):
    if name == "float32":
        return jnp.float32
    if name == "bfloat16":
        return jnp.bfloat16
    # auto: f32 for small models (exact parity with the oracle), bf16 for big ones
    return jnp.float32 if cfg.hidden_size <= 1024 else jnp.bfloat16


def _tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")))


def _build_plugin(opts: dict):
    """(the composed routing plugin or None when every lossy knob is off, the user plugins' names).

    Order: cache_route -> topp -> the user plugins (option ``plugins``, in the given order) -> expert_budget.  Each
    user plugin is wrapped in ``glm_jax_plugins.contract.checked``: structure checked at trace time, values in-jit
    (reported through the routing summary, ``Engine._check_routing``)."""
    import glm_jax_plugins as P

    topp = opts["expert_topp"] if opts["expert_topp"] < 1.0 else None
    budget = opts["expert_budget"] if opts["expert_budget"] > 0 else None
    cr = None if opts["cache_route"] == "off" else opts["cache_route"]
    user = [(p, n) for p, n in O.load_plugins(opts["plugins"]) if not getattr(p, "is_identity", False)]
    if topp is None and budget is None and cr is None and not user:
        return None, []
    names = [n for _, n in user]
    checked = [P.contract.checked(p, i, n, error=O.PluginError) for i, (p, n) in enumerate(user)]
    return P.build(expert_topp=topp, expert_budget=budget, budget_scope=opts["budget_scope"],
                   budget_max_positions=opts["budget_max_positions"] or None, cache_route=cr,
                   route_j=opts["route_j"], route_m=opts["route_m"], route_alpha=opts["route_alpha"],
                   route_lambda=opts["route_lambda"], plugins=checked), names


def _preflight(plugin, cfg: ModelConfig):
    """Trace the composed plugin once on an abstract state (layer index traced, as in the engine): a user plugin
    that breaks the contract's structure, or branches in Python on a traced value, fails here, at load."""
    from glm_jax_plugins import contract

    st = contract.abstract_state(4, cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.norm_topk_prob,
                                 cfg.routed_scaling_factor, cfg.num_hidden_layers)
    try:
        jax.eval_shape(plugin, st)
    except O.PluginError:
        raise
    except Exception as e:                  # noqa: BLE001 - a built-in plugin failing here is a bug; say so
        raise O.PluginError(f"routing plugins {plugin.name!r}: tracing failed: {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None


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


def _routing_summary(routing, want_stats: bool) -> dict:
    """Per-forward routing numbers summed over MoE layers (inside jit): plugin stats when a plugin is active, and
    the user plugins' contract check (violation_summary)."""
    if not want_stats or not routing:
        return {}
    import glm_jax_plugins as P

    out = {}
    for before, after in routing:
        for k, v in P.stats(before, after).items():
            out[k] = out.get(k, 0.0) + v
    out["layers"] = jnp.asarray(len(routing), jnp.float32)
    out.update(violation_summary(routing))
    return out
