"""The Python API (a contract: scripts outside the repo call it).

    engine = glm_jax.Engine.load(path, **options)      # options mirror the CLI flags (glm_jax/options.py)
    engine.logits(token_ids) -> np.ndarray [T, vocab]   # full forward, no cache
    out = engine.generate("To be", max_new_tokens=32, temperature=0.0)
    out.tokens, out.text, out.stats                      # stats: prefill_tokens, prefill_s, decode_tokens, decode_tok_s...
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import stat
import sys
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import glm_jax_plugins as P
from glm_jax_plugins import contract

from . import chat, compile_cache, fileio, kernels, paths
from . import fit as F
from . import memory as MEM
from . import model as M
from . import options as O
from .errors import GlmJaxError, NonFiniteError  # noqa: F401  (re-exported)
from .experts import container as C
from .experts import store as S
from .experts import weights as W
from .experts.store import RamBudgetError
from .model.config import ModelConfig, load_config
from .experts import glm5_next_weights as G5W
from .model.glm5_next_modules import model_class
from .runtime import mesh as MESH
from .runtime.backends import backend_for
from .runtime.memory_guard import SEGMENT_MAX, MemoryGuard  # noqa: F401  (SEGMENT_MAX re-exported)
from .runtime.mesh import broadcast_ids
from .runtime.runner import GenerationResult, Runner  # noqa: F401  (re-exported)
from .runtime.runner import bucket as _bucket  # noqa: F401  (tests, tools)
from .runtime.scheduler import Request, Sampling, Scheduler

_COMPILE_S = [0.0]


def _on_event(name, secs, **kw):
    if name.startswith("/jax/core/compile/"):
        _COMPILE_S[0] += secs


jax.monitoring.register_event_duration_secs_listener(_on_event)

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


def default_model_path() -> str:
    return DEFAULT_MODEL_DIR


class Tokenizer:
    """tokenizer.json via the `tokenizers` library, plus GLM chat formatting."""

    CHAT_TOKENS = ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTok

        self.path = path
        try:
            self.tok = HFTok.from_str(fileio.read_bounded(path, fileio.TOKENIZER_MAX).decode("utf-8"))
        except Exception as e:
            raise GlmJaxError(f"{path}: cannot load tokenizer ({e})") from None
        self.template = chat.load_template(os.path.dirname(path))
        self._lock = threading.Lock()        # encode_special_tokens is the tokenizer's state: toggled under it
        self.special_tokens = {t.content: (i, t.lstrip, t.rstrip)
                               for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str) -> list:
        """Text -> ids, special-token texts parsed as the special tokens (a raw prompt is the caller's own)."""
        with self._lock:
            return self.tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list:
        """Text -> ids with special-token parsing off: ``<|system|>`` is its characters' tokens (a client's text)."""
        with self._lock:
            self.tok.encode_special_tokens = True
            try:
                return self.tok.encode(text, add_special_tokens=False).ids
            finally:
                self.tok.encode_special_tokens = False

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_id(self, s: str) -> Optional[int]:
        return self.tok.token_to_id(s)

    @property
    def supports_chat(self) -> bool:
        return self.template is not None or all(self.token_id(t) is not None for t in self.CHAT_TOKENS)

    def chat_ids(self, prompt) -> list:
        """A chat prompt: text (one user message) or a list of {"role", "content"} messages (glm_jax/chat.py)."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return chat.chat_ids(self, self.template, msgs)


VERIFY_READS = {"first": "first", "always": "always", "off": "none"}     # --verify_reads -> the container's mode


class Engine(Runner):
    """A loaded model: config, params (dense resident; experts resident or behind an expert store), tokenizer."""

    def __init__(self, path: str, cfg: ModelConfig, params: dict, opts: dict, tokenizer: Optional[Tokenizer],
                 store=None, kernel: str = "xla", plan=None):
        self.path = path
        self.cfg = cfg
        # committed to the device, like the store's banks and the cache: jit keys its compiled programs on whether
        # each argument is committed, and a mix that changes between calls compiles the same program again
        self.device = jax.devices()[0]
        self.plan = plan                                    # mesh.MeshPlan, or None: one device
        self._view = None
        self.params = params                                # -> the NNX model (nnx_model.GlmModel), placed
        self.opts = opts
        self.tokenizer = tokenizer
        self.store = store
        self.dtype = params["norm"].dtype
        self.kv_dtype = pick_kv_dtype(opts["kv_cache_dtype"], self.dtype)   # the K/V cache's storage
        self.moe_layers = cfg.moe_layers
        self._init_runtime()
        self.plugin, self.plugin_names = _build_plugin(opts)
        self.lossy = self.plugin is not None
        if self.plugin_names:
            _preflight(self.plugin, cfg)
        self.backend = backend_for(opts["fetch"], cfg, self.plugin, store, opts)     # the fetch mode, chosen once
        self.guard = MemoryGuard(self)                  # the memory plan kept at run time (from_options: its plan)
        self._scheduler = None
        self.kernel = kernel                                # who computes the experts / dense products
        self.checkpoint_dtype = declared_dtype(path) or "unknown"
        self._closed = False

    # ------------------------------------------------------------------ the model
    @property
    def params(self) -> dict:
        """The params pytree (WORKSPACE.md) of the NNX model ``self.model``: the same arrays."""
        return self._params

    @params.setter
    def params(self, params: dict):
        """Wrap a params pytree into the NNX model and place it (one device, or the mesh by the modules' logical
        axes); the compiled step then runs on its split state."""
        if self.plan is None:
            model = model_class(self.cfg)(jax.device_put(params, self.device))
        else:
            model = self.plan.place_model(model_class(self.cfg)(params))
        self.model = model
        self._params = model.params()
        self._view = None
        if self.plan is None and self.device.platform == "cpu":
            for a in jax.tree_util.tree_leaves(self._params):     # a decode step streams these once each: 2 MB pages
                if isinstance(a, jax.Array) and a.nbytes >= 2 * MEM.HUGE_PAGE:
                    MEM.huge_pages(a.unsafe_buffer_pointer(), a.nbytes, collapse=True)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: Optional[str] = None, **options) -> "Engine":
        return cls.from_options(path, O.resolve(options))

    @classmethod
    def from_options(cls, path: Optional[str], opts: "O.Options") -> "Engine":
        """``load`` with options already resolved (the CLIs: their flags, with where each value came from)."""
        if not isinstance(opts, O.Options):
            opts = O.resolve(opts)
        path = _model_dir(path)
        # before anything touches a backend: join the cluster (a no-op for one process)
        MESH.init_distributed(opts["coordinator"], opts["num_processes"], opts["process_id"],
                              {k: opts.label(k) for k in ("coordinator", "num_processes", "process_id")})
        set_compile_cache(opts["compile_cache"], opts.label("compile_cache"))
        why = MEM.budget_problem(opts["ram_gb"], opts.label("ram_gb"))
        if why:
            raise RamBudgetError(why)
        container = C.is_container(path)
        if not container:
            C.check_not_partial(path)
        cfg = load_config(path)
        if cfg.model_type == "glm5_next":
            return cls._from_glm5_next(path, opts, cfg, container)
        if opts["fetch"] == "auto" and not container:
            opts["fetch"] = "resident"
        how = _Weights.choose(path, cfg, opts)
        plan = how.plan
        if plan is not None:
            _check_mesh_options(opts, plan, opts["fetch"])
        store = fitted = None
        if opts["fetch"] == "resident" and not container:   # a plain HF dir: experts straight into params
            params = W.load_params(path, cfg, dtype=how.dtype, expert_fmt=opts["expert_format"],
                                   kernel=how.dense_kernel, dense_fmt=opts["dense_format"], fuse=how.fuse,
                                   pack=how.pack, expert_kernel=how.kernel,
                                   expert_bank=None if plan is None else
                                   (lambda load, fmt, k: plan.resident_bank(cfg.n_routed_experts, load, fmt, k)))
        else:
            params, store, fitted = _load_with_store(path, cfg, opts, container, how)
            opts["fetch"] = _settle_fetch(path, cfg, opts, container, store, fitted, plan)
        tok_path = os.path.join(path, "tokenizer.json")
        tok = Tokenizer(tok_path) if os.path.exists(tok_path) else None
        eng = cls(path, cfg, params, opts, tok, store, how.kernel, plan)
        eng.guard = MemoryGuard(eng, fitted if store is not None and opts["fetch"] != "resident" else None)
        eng._kv_planned = fitted.kv_tokens if store is not None and fitted is not None else None
        return eng

    @classmethod
    def _from_glm5_next(cls, path: str, opts: "O.Options", cfg: ModelConfig, container: bool) -> "Engine":
        """glm5_next (GLM-5.3 text): every weight resident, read from its HF checkpoint or a converted container
        (read whole); the resident one-jit step.
        Its KDA layers' state holds every token a row has seen and cannot be rolled back or cut back to a shorter
        prefix: no speculative decoding; a row's cache is reused only by a prompt extending everything it holds
        (Runner.recurrent_state)."""
        what = f"{path}: glm5_next (GLM-5.3)"
        if opts["fetch"] not in ("auto", "resident"):
            raise GlmJaxError(f"{what}: {opts.label('fetch')}={opts['fetch']} is not supported yet (every expert "
                              f"resident: fetch=resident{', the container read whole into RAM' if container else ''})")
        if opts["mesh"]:
            raise GlmJaxError(f"{what}: {opts.label('mesh')} is not supported yet")
        if opts["dense_format"] != "native":
            raise GlmJaxError(f"{what}: {opts.label('dense_format')}={opts['dense_format']} is not supported yet (its "
                              f"dense weights run as stored)")
        if opts["draft"] > 0:
            raise GlmJaxError(f"{what}: {opts.label('draft')}: its KDA state cannot be rolled back (no speculative "
                              f"decoding)")
        opts["fetch"] = "resident"
        dtype = _pick_dtype(opts["dtype"], path, cfg)
        kernel = _pick_kernel(opts["kernels"])
        if container:       # every expert read into RAM in the container's format (no streamed path yet)
            params = G5W.load_container_params(path, cfg, dtype=dtype, kernel=kernel)
        else:
            params = G5W.load_params(path, cfg, dtype=dtype, expert_fmt=opts["expert_format"], kernel=kernel)
        tok_path = os.path.join(path, "tokenizer.json")
        eng = cls(path, cfg, params, opts, Tokenizer(tok_path) if os.path.exists(tok_path) else None, None, kernel)
        eng._kv_planned = None          # (its memory guard keeps no plan: Engine.__init__'s)
        return eng

    # ------------------------------------------------------------------ public API
    def logits(self, token_ids) -> np.ndarray:
        """Full forward over token_ids (a list / 1-D array -> [T, V]; a list of lists -> list of [T_i, V])."""
        _check_seq(token_ids, "logits")
        if len(token_ids) and isinstance(token_ids[0], (list, tuple, np.ndarray)):
            return self.batch_logits(token_ids)
        return self.batch_logits([token_ids])[0]

    def batch_logits(self, seqs: Sequence[Sequence[int]]) -> list:
        """Teacher-forced logits for a batch of sequences (right-padded, one forward)."""
        self._check_open()
        _check_seq(seqs, "batch_logits")
        if len(seqs) == 0:
            raise GlmJaxError("batch_logits: empty batch (expected a list of token-id sequences)")
        seqs = [self._token_ids(s, "batch_logits") for s in seqs]
        for s in seqs:
            if not s:
                raise GlmJaxError("logits: empty token sequence")
            if len(s) > self.context_limit:
                raise GlmJaxError(f"logits: the sequence is {len(s)} tokens but the context limit is "
                                  f"{self.context_limit} tokens")
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

    def _token_ids(self, seq, where: str) -> list:
        """A sequence of ints in the vocabulary, as a list (no silent truncation of floats, no strings)."""
        _check_seq(seq, where)
        out = []
        for t in seq:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                raise GlmJaxError(f"{where}: token ids must be integers, got {t!r} ({type(t).__name__})")
            t = int(t)
            if not 0 <= t < self.cfg.vocab_size:
                raise GlmJaxError(f"{where}: token id {t} outside the vocabulary [0, {self.cfg.vocab_size})")
            out.append(t)
        return out

    def encode(self, text, chat: bool = False) -> list:
        """Token ids of text; ``chat=True``: of a chat prompt (text = one user message, or a list of
        {"role", "content"} messages) formatted by the checkpoint's chat_template (glm_jax/chat.py)."""
        self._check_open()
        if not isinstance(text, str) and not (chat and isinstance(text, list)):
            raise GlmJaxError(f"encode: expected text (str), got {type(text).__name__}")
        if self.tokenizer is None:
            raise GlmJaxError(f"{self.path}: no tokenizer.json; pass token ids instead of text")
        if jax.process_count() > 1:         # process 0 tokenizes; every process must call this (a collective)
            return broadcast_ids(lambda: self.tokenizer.chat_ids(text) if chat else self.tokenizer.encode(text))
        return self.tokenizer.chat_ids(text) if chat else self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        """Token ids -> text ("" without a tokenizer, and on every process but 0 of a multi-process run: process 0
        prints)."""
        if self.tokenizer is None or jax.process_index() != 0:
            return ""
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------------ generation (scheduler.py)
    @property
    def scheduler(self):
        """The engine's continuous-batching scheduler (``--max_batch`` rows, ``--prefill_chunk``)."""
        if self._scheduler is None:
            self._scheduler = Scheduler(self, max_batch=self.opts["max_batch"],
                                        prefill_chunk=self.opts["prefill_chunk"], dispatch_ms=self.opts["dispatch_ms"],
                                        stream_interval=self.opts["stream_interval"],
                                        prefix_cache=self.opts["prefix_cache"],
                                        prefix_store_mb=prefix_store_mb(self.opts, self.store))
        return self._scheduler

    def request(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int = 0, chat: bool = False, stop_on_eos: bool = True, stop=None,
                on_event=None, where: str = "generate"):
        """A checked ``scheduler.Request`` (not yet submitted): prompt = text, token ids, or with ``chat`` a list
        of messages; ``stop``: stop strings (str or list of str)."""
        self._check_open()
        for name, v in (("chat", chat), ("stop_on_eos", stop_on_eos)):
            if not isinstance(v, (bool, np.bool_)):
                raise GlmJaxError(f"{where}: {name} must be True or False, got {v!r}")
        if isinstance(prompt, str) or (chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            ids = self.encode(prompt, chat=bool(chat))
        else:
            if chat:
                raise GlmJaxError(f"{where}: chat=True needs a text prompt or a list of messages")
            ids = self._token_ids(prompt, where)
        if not ids:
            if isinstance(prompt, str) and prompt:
                shown = prompt if len(prompt) <= 40 else prompt[:40] + "..."
                raise GlmJaxError(f"{where}: the prompt text {shown!r} encodes to no tokens (the tokenizer maps it "
                                  f"to nothing); give other text or token ids")
            raise GlmJaxError(f"{where}: empty prompt")
        V = self.cfg.vocab_size
        s = Sampling(max_new_tokens=_arg_int("max_new_tokens", max_new_tokens, 0, None, where=where),
                     temperature=_arg_float("temperature", temperature, 0.0, None, where=where),
                     top_k=_arg_int("top_k", top_k, 0, V, f" (0 = off; the vocabulary has {V} tokens)", where=where),
                     top_p=_arg_float("top_p", top_p, 0.0, 1.0, open_lo=True, where=where),
                     seed=_arg_int("seed", seed, -(1 << 63), (1 << 63) - 1, where=where),
                     stop_on_eos=bool(stop_on_eos), stop=_stop_strings(stop, where))
        if s.stop and self.tokenizer is None:
            raise GlmJaxError(f"{where}: stop strings need a tokenizer ({self.path} has no tokenizer.json)")
        return Request(ids, s, on_event=on_event, decode=self.decode if self.tokenizer is not None else None)

    def generate(self, prompt_or_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, chat: bool = False, stop_on_eos: bool = True, stop=None):
        """Generate from one prompt (text, token ids; with ``chat`` also a list of messages) -> GenerationResult,
        or from a list of prompts -> a list of GenerationResult, decoded together (continuous batching over
        ``--max_batch`` rows; each prompt's output is the same as alone at that width)."""
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  chat=chat, stop_on_eos=stop_on_eos, stop=stop)
        self._check_open()
        if _is_batch(prompt_or_ids, chat):
            if not prompt_or_ids:
                raise GlmJaxError("generate: empty list of prompts")
            reqs = [self.request(p, where=f"generate[{i}]", **kw) for i, p in enumerate(prompt_or_ids)]
        else:
            reqs = [self.request(prompt_or_ids, **kw)]
        sched = self.scheduler
        for r in reqs:
            sched.check(r.prompt, r.sampling)
        self._route_acc = {}
        if self.store is not None:
            self.store.reset_stats()
        compile0 = self.compile_s
        try:
            for r in reqs:
                sched.submit(r)
            sched.run(reqs)
        except BaseException:
            for r in reqs:
                sched.cancel(r)
            sched._reap()
            raise
        self.guard.refit()
        out = [sched.result(r, compile0) for r in reqs]
        if self.plan is not None:
            for res in out:
                res.stats.update(mesh=self.plan.describe(), processes=jax.process_count(), expert_comm=self.plan.comm)
        return out if _is_batch(prompt_or_ids, chat) else out[0]

    def stream(self, prompt_or_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, chat: bool = False, stop_on_eos: bool = True, stop=None):
        """Like ``generate`` for one prompt, as an iterator of text pieces as they are generated (UTF-8 safe:
        a character split over tokens comes out whole).  After the last piece, ``.result`` is the
        GenerationResult.  Closing the iterator early (``break``) cancels the request and frees its row."""
        req = self.request(prompt_or_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, chat=chat, stop_on_eos=stop_on_eos, stop=stop, where="stream")
        self.scheduler.check(req.prompt, req.sampling)     # now, not at the first next(): as generate() does
        return _Stream(self, req)

    # ------------------------------------------------------------------ memory (runtime/memory_guard.py)
    def memory_guard(self, kv_positions: int = 0, rows: int = 1):
        self.guard.memory_guard(kv_positions, rows)

    def memory_settled(self):
        self.guard.refit()

    def warmed_up(self):
        self.guard.warmed_up()

    def kv_give_back(self) -> bool:
        return self.guard.kv_give_back()

    def before_new_shapes(self):
        self.guard.before_new_shapes()

    def segment_tokens(self, remaining: int, chunk: int):
        return self.guard.segment_tokens(remaining, chunk)

    def segment_done(self):
        self.guard.segment_done()

    def shrink_cache(self, batch: int, cap: int):
        """Runner.shrink_cache, and the programs compiled for the longer cache dropped with it: every step's shapes
        follow the cache's length, so they never run again, and in the GLM-4.5-Air slice's 0.3x box they held
        ~100 MB after a 1500-token prompt (docs/real-scale.md, memory guard).  The ones still needed are compiled again
        (from the compilation cache on disk: ~0.7 s there)."""
        before = self._cache_len
        super().shrink_cache(batch, cap)
        if self._cache_len < before:
            self.guard.drop_programs()

    def _kv_bytes(self) -> int:
        return _tree_bytes(self._cache) if self._cache is not None else 0


    @property
    def compile_s(self) -> float:
        """Seconds spent tracing + compiling jitted functions in this process (all engines)."""
        return _COMPILE_S[0]

    def close(self):
        if self._closed:
            return
        self._closed = True
        if self.store is not None:
            self.store.close()


# ----------------------------------------------------------------------------- helpers
def _model_dir(path) -> str:
    """The model directory ``Engine.load`` was given (default: the shipped model), checked to be one."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise GlmJaxError(f"Engine.load: path must be a directory name (str), got {type(path).__name__}")
    path = os.fspath(path) if path else default_model_path()
    if not os.path.isdir(path):
        raise GlmJaxError(f"{path}: model directory not found" if not os.path.exists(path)
                          else f"{path}: not a directory (expected a model directory)")
    return path


@dataclasses.dataclass(frozen=True)
class _Weights:
    """How the weights load: dtypes, who computes (the experts' kernel, the dense weights'), the mesh plan."""
    dtype: object
    kv_dtype: object
    kernel: str
    plan: object
    dense_kernel: str
    fuse: bool
    pack: Optional[bool]

    @staticmethod
    def choose(path: str, cfg: ModelConfig, opts) -> "_Weights":
        dtype = _pick_dtype(opts["dtype"], path, cfg)
        kernel = _pick_kernel(opts["kernels"])
        plan = MESH.plan_for(opts, cfg, opts.label("mesh"))
        # a tensor-parallel mesh: dense weights unfused, on the XLA path (mesh.py); the experts keep ``kernel``
        fuse = plan is None or plan.model == 1
        return _Weights(dtype=dtype, kv_dtype=pick_kv_dtype(opts["kv_cache_dtype"], dtype), kernel=kernel,
                        plan=plan, dense_kernel=kernel if fuse else "xla", fuse=fuse,
                        pack=None if fuse else True)    # tensor-parallel: stored bf16 / int8 dense weights stay so


def _load_with_store(path: str, cfg: ModelConfig, opts, container: bool, how: _Weights):
    """The dense weights into params and the routed experts behind an expert store (a container, or an HF dir
    streamed / on a mesh), fitted to the RAM budget.  Returns (params, store, fitted: the memory plan or None)."""
    src = store = fitted = None
    verify = VERIFY_READS[opts["verify_reads"]]
    try:
        if container:     # manifest, config and sizes checked at open; the dense file's crc before use
            src = C.open_container(path, cfg, verify=verify, direct_io=opts["direct_io"])
            C.verify_dense(path, src.manifest)
        if how.plan is None:  # what fits, from headers and the manifest: refused here, before any weights
            src = src if src is not None else C.open_expert_source(path, cfg, verify=verify)
            fitted = fit_memory(path, cfg, opts, src, how.dtype, how.kv_dtype, how.dense_kernel, how.pack)
            if not fitted.all_fit:
                # the budget binds: big blocks freed go back to the OS, so that the expert cache keeps
                # the room the refit measures for it (memory.compact_heap)
                MEM.compact_heap()
            if container and fitted.direct_io != src.direct_io:
                src.close()
                src = C.open_container(path, cfg, verify=verify, direct_io=fitted.direct_io)
            opts["direct_io"] = fitted.direct_io
            opts["dense_format"] = fitted.dense_format
            if fitted.prefill_chunk and fitted.prefill_chunk < opts["prefill_chunk"]:
                opts["prefill_chunk"] = fitted.prefill_chunk
        if container:
            params = W.load_dense_params(path, cfg, dtype=how.dtype, file=src.dense_path, kernel=how.dense_kernel,
                                         dense_fmt=opts["dense_format"], fuse=how.fuse, pack=how.pack)
        else:
            params = W.load_params(path, cfg, dtype=how.dtype, expert_fmt=None, kernel=how.dense_kernel,
                                   dense_fmt=opts["dense_format"], fuse=how.fuse, pack=how.pack)
        if fitted is not None:
            # a RAM budget: the loader's programs (quantize, pack) never run again in this run, and
            # what they hold would count against the expert cache (~20 MB in the 0.3x slice box)
            jax.clear_caches()
        MEM.trim()
        if how.plan is not None:
            src = src if src is not None else C.open_expert_source(path, cfg, verify=verify,
                                                                   direct_io=opts["direct_io"])
        store = _open_store(path, cfg, opts, src, fitted, how)
    except BaseException:
        if src is not None and store is None:
            src.close()
        raise
    store.sim_disk_gbps, store.sim_expert_mb = opts["sim_disk_gbps"], opts["sim_expert_mb"]
    return params, store, fitted


def _open_store(path: str, cfg: ModelConfig, opts, src, fitted, how: _Weights):
    """The expert store over ``src``, sized by the memory plan ``fitted`` (None: by the options)."""
    plan = how.plan
    cap = opts["cache_cap"] or None
    if plan is not None and cap:           # --cache_cap: per layer, split over the expert shards
        cap = max(1, -(-cap // plan.expert))
    opener = S.ExpertStore.open if plan is None else functools.partial(S.ShardedStore.open, plan)
    kv_item = jnp.dtype(how.kv_dtype).itemsize
    return opener(path, cfg, cache_cap=cap,
                  ram_gb=opts["ram_gb"] or None,
                  direct_io=opts["direct_io"], io_threads=opts["io_threads"],
                  read_chunk_mb=opts["read_chunk_mb"],
                  pin=opts["pin"] or None, pin_gb=opts["pin_gb"],
                  policy=opts["cache_policy"],
                  # the whole process counts: what it holds now (runtime + dense weights) and a reserve for
                  # compilation and the step's buffers
                  used_bytes=MEM.private_bytes() + (RUNTIME_RESERVE if fitted is None else fitted.workspace)
                  + prefix_store_reserve(opts),
                  kv_bytes=(M.kv_bytes_per_token(cfg, kv_item) *
                            (opts["max_seq_len"] or F.KV_DEFAULT_TOKENS) * opts["max_batch"]
                            if fitted is None else fitted.kv_bytes),
                  # slots for one decode / verify's union; a larger one (a prefill) is fetched and computed in
                  # chunks of this many experts (streaming.py)
                  max_working_set=(fitted.working_set if fitted is not None
                                   and fitted.working_set else working_set(cfg, opts)),
                  source=src,
                  state_dir=opts["state_dir"],
                  labels={k: opts.label(k) for k in ("pin", "ram_gb")}, kernel=how.kernel,
                  **({} if fitted is None or cap else    # an explicit --cache_cap stays
                     {"headroom_bytes": F.COMPILE_TRANSIENT}))


def _settle_fetch(path: str, cfg: ModelConfig, opts, container: bool, store, fitted, plan) -> str:
    """The fetch mode of a store-backed load (Engine builds its backend from it): under --fetch=auto / resident
    with a container, every expert cached and (the plan's) room for the resident run's whole-model programs too:
    the store preloaded, one compiled step per token over its slot arenas (no per-layer host round trip);
    otherwise streamed: fused where the banks alias the store's arenas on one device (its decode runs without a
    host call while every expert it meets is cached), else loop.  --fetch=resident refused where it can't hold."""
    fetch = opts["fetch"]
    resident = store.can_hold_all() and (fitted is None or fitted.all_fit)
    if fitted is not None and (fitted.notes or (not resident and not opts["cache_cap"])):
        # the memory plan in one line, whenever memory decided something
        print(fitted.line(fitted.inputs, store.cache_cap, resident), file=sys.stderr)
    if fetch == "resident" and container and store.can_hold_all() and not resident:
        code = fitted.inputs.resident_code
        store.close(save_usage=False)
        fl = opts.label("fetch")
        raise RamBudgetError(f"{path}: {fl}=resident: every expert fits, but not the compiled programs of a "
                             f"resident run ({code / 1e9:.2f} GB at {cfg.num_hidden_layers} layers; raise "
                             f"{opts.label('ram_gb')}, or leave {fl} unset: every expert cached, streamed)")
    if fetch in ("auto", "resident") and container:
        if resident:
            store.preload_all()
            return "resident"
        if fetch == "resident":
            cap, E = store.cache_cap, cfg.n_routed_experts
            store.close(save_usage=False)
            raise RamBudgetError(f"{path}: --fetch=resident needs every expert in RAM, but the budget "
                                 f"holds {cap} of {E} per layer (raise {opts.label('ram_gb')} or "
                                 f"--cache_cap, or use --fetch=loop)")
        return "fused" if store.aliased and plan is None and (fitted is None or fitted.fused) else "loop"
    if fetch == "resident":
        raise GlmJaxError(f"{path}: --fetch=resident needs a plain HF checkpoint or a container")
    return fetch


def _check_mesh_options(opts, plan, fetch: str):
    """What a mesh does not run (one line naming the option)."""
    if fetch in ("callback", "fused"):
        raise GlmJaxError(f"{opts.label('fetch')}={fetch}: runs on one device (the mesh {plan.describe()} needs "
                          f"--fetch=resident or loop)")
    if opts["pin"]:
        raise GlmJaxError(f"{opts.label('pin')}={opts['pin']}: pinned experts are not supported on a mesh yet "
                          f"(--mesh={plan.describe()})")
    if jax.process_count() > 1:
        uses_residency = (opts["cache_route"] != "off" or
                          (opts["expert_budget"] > 0 and opts["budget_residency"] != "none"))
        if uses_residency:
            name = "cache_route" if opts["cache_route"] != "off" else "budget_residency"
            raise GlmJaxError(f"{opts.label(name)}: decisions that depend on what each process has cached would "
                              f"differ between the {jax.process_count()} processes (use --budget_residency=none, "
                              f"no --cache_route)")


def declared_dtype(path: str) -> str:
    """The checkpoint's declared dtype (config.json ``dtype`` / ``torch_dtype``), "" if none."""
    try:
        c = fileio.read_json(os.path.join(path, "config.json"))
    except OSError:
        return ""
    if not isinstance(c, dict):
        return ""
    d = c.get("dtype") or c.get("torch_dtype") or ""
    return d if isinstance(d, str) else ""


def _check_seq(x, where: str):
    if isinstance(x, (str, bytes, bytearray)) or not hasattr(x, "__len__") or not hasattr(x, "__iter__"):
        raise GlmJaxError(f"{where}: expected a sequence of token ids (ints), got {type(x).__name__}"
                          + (" (text goes to generate(); logits take token ids: engine.encode(text))"
                             if isinstance(x, str) else ""))


def _is_batch(p, chat) -> bool:
    """A list of prompts (not one prompt of token ids, nor one chat of messages)."""
    if not isinstance(p, (list, tuple)) or not p:
        return False
    first = p[0]
    if isinstance(first, dict):
        return False
    return isinstance(first, (str, list, tuple, np.ndarray))


def _stop_strings(stop, where) -> tuple:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise GlmJaxError(f"{where}: stop must be a string or a list of strings")
    if len(stop) > 16:
        raise GlmJaxError(f"{where}: at most 16 stop strings, got {len(stop)}")
    return tuple(s for s in stop if s)


class _Stream:
    def __init__(self, engine, req):
        self.engine, self.req = engine, req
        self.result = None
        self.compile0 = engine.compile_s
        self._pieces = []
        req.on_event = lambda r, text, toks, done: self._pieces.append(text) if text else None
        self._started = False

    def __iter__(self):
        return self._drive(False)

    def _each_token(self):
        """Like iterating, but also yields None after every scheduler step (a model without a tokenizer has no
        text pieces: its caller shows ``tokens`` as they grow)."""
        return self._drive(True)

    def _drive(self, every_step: bool):
        e, req = self.engine, self.req
        sched = e.scheduler
        e._route_acc = {}
        if e.store is not None:
            e.store.reset_stats()
        compile0 = self.compile0 = e.compile_s
        sched.submit(req)
        try:
            while not req.done:
                if sched.serving:
                    req.done_event.wait(0.05)
                else:
                    sched.step()
                if every_step:
                    yield None
                while self._pieces:
                    yield self._pieces.pop(0)
            while self._pieces:
                yield self._pieces.pop(0)
            e.guard.refit()
            self.result = sched.result(req, compile0)
            if e.plan is not None:           # the mesh line, as generate() gives it
                self.result.stats.update(mesh=e.plan.describe(), processes=jax.process_count(),
                                         expert_comm=e.plan.comm)
        finally:
            if not req.done:
                sched.cancel(req)
                sched._reap()

    @property
    def tokens(self) -> list:
        return list(self.req.out)


def _arg_int(name, v, lo, hi, note="", where="generate"):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise GlmJaxError(f"{where}: {name} must be an integer, got {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise GlmJaxError(f"{where}: {name}={v} out of range (expected {rng}){note}")
    return v


def _arg_float(name, v, lo, hi, open_lo=False, where="generate"):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise GlmJaxError(f"{where}: {name} must be a finite number, got {v!r}")
    v = float(v)
    if v < lo or (open_lo and v == lo) or (hi is not None and v > hi):
        rng = f"{'(' if open_lo else '['}{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
        raise GlmJaxError(f"{where}: {name}={v:g} out of range (expected {rng})"
                          + (" (0 = greedy)" if name == "temperature" else ""))
    return v


_COMPILE_CACHE = [None]      # the persistent-cache directory this process set (None: none set by glm-jax)


_HEALED: set = set()


def _trusted_cache_dir(d: str, opt: str, label: str) -> Optional[str]:
    """The compilation cache's entries are native code this process loads: the directory must be this user's, like
    the kernels' (kernels.dir_problem: owner and no group / world write, up to the root); one of ours that others
    may write is made private (and said so).  Otherwise an explicit one is an error and the default one unused."""
    try:
        st = os.stat(d)
        if st.st_uid == os.getuid() and st.st_mode & 0o022:
            os.chmod(d, stat.S_IMODE(st.st_mode) & ~0o077)
            print(f"glm-jax: note: {label} {d} was writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                  f"made it mode {stat.S_IMODE(st.st_mode) & ~0o077:o}", file=sys.stderr, flush=True)
    except OSError:
        pass
    why = kernels.dir_problem(d)
    if why is None:
        return d
    if opt:
        raise GlmJaxError(f"{label}={opt}: not used as the compilation cache: {why} (its entries are code this "
                          f"process would run)")
    print(f"glm-jax: note: running without the compilation cache {d} ({why})", file=sys.stderr, flush=True)
    return None


def set_compile_cache(opt: str = "", label: str = "--compile_cache"):
    """Point JAX's persistent compilation cache at the per-user cache dir (``paths.cache_root``), another directory,
    or nowhere ('off').  Every program is cached (min compile time 0), so a second start compiles nothing.  An
    unusable default location runs without a cache; an unusable explicit one is an error."""
    d = paths.cache_root(opt)
    if d is not None:
        try:
            os.makedirs(d, exist_ok=True)
            if not os.access(d, os.W_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            if opt:
                raise GlmJaxError(f"{label}={opt}: cannot use it as the compilation cache ({e.strerror or e})") from None
            d = None
    if d is not None:
        d = _trusted_cache_dir(d, opt, label)
    cur = jax.config.jax_compilation_cache_dir
    if d is not None and d not in _HEALED:      # unreadable entries removed, once per directory and process
        _HEALED.add(d)
        compile_cache.heal(d)
    if d == cur:
        return
    if d is None and _COMPILE_CACHE[0] is None and opt != "off":
        return          # default location unusable: leave whatever the caller configured
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_compilation_cache_dir", d)
    if d is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()
    _COMPILE_CACHE[0] = d


def _pick_dtype(name: str, path: str, cfg: ModelConfig):
    """The compute (activation) dtype.  auto: on CPU float32 whatever the checkpoint declares -- XLA:CPU has no fast
    bf16 arithmetic (0.44 vs 3.6 GMAC/s for f32, limits-and-peers.md section 6) and the native kernels keep bf16
    weights in bf16 while computing in f32, so a bf16 checkpoint loses no memory for it; elsewhere the checkpoint's
    declared dtype (bfloat16 or float32; float16 -> bfloat16)."""
    if name == "float32":
        return jnp.float32
    if name == "bfloat16":
        return jnp.bfloat16
    if jax.default_backend() == "cpu":
        return jnp.float32
    return jnp.bfloat16 if declared_dtype(path) in ("bfloat16", "float16") else jnp.float32


def pick_kv_dtype(name: str, dtype):
    """The K/V cache's storage dtype (--kv_cache_dtype).  auto: float16 where the compute dtype is float32 (half a
    float32 cache's bytes, llama.cpp's default; float16's 10-bit mantissa against bfloat16's 7, and K/V values sit
    far inside its range), GQA and MLA models alike (an MLA f16 decode once measured slower only because the expert
    cache gave all its experts for a few MB; ExpertStore.shrink_cap no longer steps where that frees nothing).  Else the
    compute dtype."""
    if name != "auto":
        return jnp.dtype(name).type
    return jnp.float16 if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype).type


def prefix_store_mb(opts, store) -> float:
    """--prefix_store_mb as the run uses it.  Given: as given (a streamed load counted it in its budget).  Not
    given: the default without an expert store; with every expert in the store's RAM, at most a quarter of the RAM
    budget still free; streamed, off (every byte of the budget went to the plan)."""
    if opts.where("prefix_store_mb") or store is None:
        return float(opts["prefix_store_mb"])
    if opts["fetch"] != "resident":
        return 0.0
    free = store.sizing.get("budget_bytes", 0) - MEM.private_bytes()
    return min(float(opts["prefix_store_mb"]), max(0.0, free / 4 / 1e6))


def prefix_store_reserve(opts) -> int:
    """Bytes a store-backed load reserves in its RAM budget for the prefix store (only when the flag is given)."""
    return int(opts["prefix_store_mb"] * 1e6) if opts.where("prefix_store_mb") else 0


RUNTIME_RESERVE = 150 << 20   # compile workspace + the step's buffers beyond the resident set at open (measured:
                              # 15-60 MB on the 1.9 GB synthetic model; python -m tools.bench --mode=lowram)


def fit_memory(path: str, cfg: ModelConfig, opts: "O.Options", src, dtype, kv_dtype, dense_kernel: str, pack):
    """The memory plan of a streamed / store-backed load (glm_jax/fit.py), from headers, the manifest and the
    resident set now: the dense storage format, the KV reservation, direct I/O.  Raises RamBudgetError (one line)
    before anything large is read when not even one expert per layer fits."""
    item = jnp.dtype(dtype).itemsize
    kv_item = jnp.dtype(kv_dtype).itemsize
    tensors = F.header_tensors(path)
    fixed_dense = bool(opts.where("dense_format"))
    fmts = [opts["dense_format"]] if fixed_dense else ["native", *F.QUANT_STEPS]
    dense, extra = {}, {}
    for f in fmts:
        packed = (dense_kernel == "native" or f != "native") if pack is None else pack
        key = "native" if fixed_dense else f       # an explicit --dense_format: the only candidate
        dense[key], extra[key] = F.dense_bytes(tensors, cfg, f, packed, item)
    layers = list(src.expert_layers)
    rec = {L: src.layout(L).record_len for L in layers}
    max_rec = max(rec.values()) if rec else 0
    ctx = min(int(cfg.max_position_embeddings), int(opts["max_seq_len"] or cfg.max_position_embeddings))
    if opts["max_seq_len"]:
        kv_tokens, kv_fixed = ctx, True
    elif opts["reserve_tokens"]:
        kv_tokens, kv_fixed = min(ctx, _bucket(opts["reserve_tokens"], 256)), True
    else:
        kv_tokens, kv_fixed = min(ctx, F.KV_DEFAULT_TOKENS), False
    # a prefill chunk is never longer than the context; lowered with the KV reservation unless given
    chunk = min(opts["prefill_chunk"], ctx)
    if opts["ram_gb"]:
        budget, why = int(opts["ram_gb"] * 1e9), opts.label("ram_gb")
    else:
        budget, why = MEM.default_budget()
    E = max(src.num_experts(L) for L in layers) if layers else 0
    read_buffers = src.read_buffer_bytes(opts["io_threads"])
    base = F.FitInputs(
        budget=budget, budget_from=why, runtime=MEM.private_bytes() + F.LOAD_OVERHEAD + prefix_store_reserve(opts),
        dense=dense, dense_fixed=fixed_dense, load_extra=extra, kv_per_token=0, kv_tokens=kv_tokens,
        kv_fixed=kv_fixed, workspace=0, prefill_chunk=chunk, act_per_position=F.activation_bytes(cfg, item),
        chunk_fixed=bool(opts.where("prefill_chunk")), resident_code=F.resident_code_bytes(cfg),
        layers=cfg.num_hidden_layers, fetch=opts["fetch"], top_k=cfg.num_experts_per_tok, max_rec=max_rec,
        released=S.working_set_released(src, layers), rec_sum=sum(rec.values()), buffers=read_buffers,
        pin_bytes=int(opts["pin_gb"] * 1e9) if opts["pin"] else 0, num_experts=E,
        cache_cap=opts["cache_cap"] or None, direct_io=opts["direct_io"] if opts.where("direct_io") else None)

    def inputs_at(rows: int) -> F.FitInputs:        # the plan's inputs at ``rows`` rows of the scheduler
        ws = F.workspace_bytes(cfg, chunk, rows, item)
        W_ = min(E, working_set(cfg, dict(opts, max_batch=rows))) if layers else 0
        return dataclasses.replace(base, kv_per_token=M.kv_bytes_per_token(cfg, kv_item) * rows, workspace=ws,
                                   persistent=ws - F.COMPILE_TRANSIENT, working_set=W_,
                                   buffers=read_buffers + W_ * max_rec)

    try:
        if opts.is_auto("max_batch"):          # glm-jax-serve's rows, not the user's: fewer where memory is short
            rows, p, inp = F.plan_rows(inputs_at, opts["max_batch"])
            opts["max_batch"] = rows
        else:
            inp = inputs_at(opts["max_batch"])
            p = F.plan(inp)
    except F.FitError as e:
        src.close()
        raise RamBudgetError(f"{path}: {e}") from None
    if p.working_set:
        inp = F.with_working_set(inp, p.working_set)
    if fixed_dense:
        p = dataclasses.replace(p, dense_format=opts["dense_format"])
    if p.direct_io and inp.direct_io is None:
        # where the file system takes O_DIRECT (tmpfs does not): else buffered reads, said in the line
        first = getattr(src, "entry", None)
        fd = C._open_direct(first(layers[0]).path) if first is not None and layers else None
        if fd is None:
            p = dataclasses.replace(p, direct_io=False, notes=tuple(
                "O_DIRECT unsupported here" if n == F.DIRECT_NOTE else n for n in p.notes))
        else:
            os.close(fd)
    return _Fitted(p, inp)


class _Fitted:
    """A fit.FitPlan with its inputs (the engine's memory decisions at load)."""

    def __init__(self, plan, inputs):
        self.plan, self.inputs = plan, inputs

    def __getattr__(self, name):
        return getattr(self.plan, name)

    def line(self, inputs, cache_cap=None, resident=None):
        return self.plan.line(inputs, cache_cap, resident)


def working_set(cfg: ModelConfig, opts: Optional[dict] = None) -> int:
    """Expert slots per layer beyond the retained cache: the union of one decode forward, i.e. top-k times its real
    positions (one per row of ``--max_batch``, or 1 + the draft tokens of one row's speculative verify).  Larger unions (a prefill) are fetched in
    chunks of this size."""
    width, rows = 1, 1
    if opts is not None:
        d = opts["draft"]
        if d < 0:
            d = 3 if (opts["mtp"] and cfg.has_mtp and opts["draft_source"] in ("auto", "mtp")) else 0
        width += max(0, d)
        rows = opts["max_batch"]
    return min(cfg.n_routed_experts, max(width, rows) * cfg.num_experts_per_tok)


def _pick_kernel(mode: str) -> str:
    """--kernels: "native" where the C++ kernels build (or are cached) here, else "xla"."""
    if mode == "xla":
        return "xla"
    try:
        if kernels.load(required=(mode == "native")):
            return "native"
    except kernels.KernelError as e:
        raise GlmJaxError(f"option 'kernels': {e}") from None
    from absl import logging

    logging.warning("glm-jax: native kernels unavailable (%s); using the XLA path (slower)", kernels.last_error())
    return "xla"


def _tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")))


def _build_plugin(opts: dict):
    """(the composed routing plugin or None when every lossy knob is off, the user plugins' names).

    Order: cache_route -> topp -> the user plugins (option ``plugins``, in the given order) -> expert_budget.  Each
    user plugin is wrapped in ``glm_jax_plugins.contract.checked``: structure checked at trace time, values in-jit
    (reported through the routing summary, ``Runner._check_routing``)."""
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
    st = contract.abstract_state(4, cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.norm_topk_prob,
                                 cfg.routed_scaling_factor, cfg.num_hidden_layers)
    try:
        jax.eval_shape(plugin, st)
    except O.PluginError:
        raise
    except Exception as e:                  # noqa: BLE001 - a built-in plugin failing here is a bug; say so
        raise O.PluginError(f"routing plugins {plugin.name!r}: tracing failed: {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None