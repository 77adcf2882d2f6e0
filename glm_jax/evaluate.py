"""`glm-jax-eval`: the quality gate.  A configuration (any engine flags: --expert_budget, --expert_topp, ...) versus
the same model with no lossy plugin, on held-out text:

* perplexity of both (teacher forced);
* KL(reference || config) per token and top-1 agreement of the two next-token distributions;
* a next-line multiple-choice test ("our hellaswag"): context = a few lines of a held-out play, candidates = the true
  next line + 3 distractor lines from OTHER plays; each candidate scored by its summed log-likelihood (acc), by its
  per-token mean (acc_norm) and by log P(line | context) - log P(line | "\n") (acc_pmi: how much the context helps,
  the score that separates a weak model from chance); fixed seed, >= 200 items;
* a verdict line: PASS when each measure is within its threshold of the reference (--max_ppl_increase, --max_kl,
  --min_top1, --max_mc_drop: options.EVAL_OPTIONS), exit status 0; FAIL naming the measures that are not, exit 1.

``--check_contract`` checks MTP's contract for the given plugins instead (:func:`check_contract`): greedy generation
with and without MTP drafts must give the same tokens; each plugin is also classified (routing-only vs
cache-dependent, row-independent or not) by glm_jax_plugins.contract.classify.  Exit status 0 when the outputs are
identical, 1 when they differ.

    glm-jax-eval --check_contract --plugin=glm_jax_plugins.weight_floor:weight_floor --plugin_args=min_share=0.2

Scoring is decode-faithful: the text runs through the KV cache in chunks of ``--score_chunk`` positions (default 4,
the size of an MTP verify and of the budget's default position guard), so lossy plugins act as they do when
generating.  Candidates of one item share the context's cache (rewound, not recomputed).

    glm-jax-eval [--model=DIR] --expert_budget=4 --budget_scope=position [--items=200] [--windows=16]
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np
from absl import app, flags

import glm_jax_plugins as P
from glm_jax_plugins.contract import describe

from . import options as O
from .engine import Engine
from .errors import GlmJaxError
from .options import define_once as once
from .runtime.stats import route_stats

FLAGS = flags.FLAGS


def define_flags():
    """Flags of glm-jax-eval (defined on demand so other tools can import this module; idempotent, and a flag another
    command already defined with the same meaning (--model, --output_json) is reused)."""
    once(flags.DEFINE_string, "model", "", "Model directory (default: the embedded default model).")
    once(flags.DEFINE_string, "text", "", "Held-out text: a file with plays separated by lines '=== <name> ===' "
         "(default: <model>/heldout.txt).")
    once(flags.DEFINE_integer, "items", 200, "Multiple-choice items (0: perplexity / KL / top-1 only).",
         lower_bound=0)
    once(flags.DEFINE_integer, "windows", 16, "Perplexity windows.", lower_bound=1)
    once(flags.DEFINE_integer, "window_len", 128, "Tokens per perplexity window.", lower_bound=2)
    once(flags.DEFINE_integer, "context_lines", 6, "Lines of context per multiple-choice item.", lower_bound=1)
    once(flags.DEFINE_integer, "score_chunk", 4, "Positions per forward when scoring (1 = exactly like decode).",
         lower_bound=1)
    once(flags.DEFINE_integer, "eval_batch", 1, "Score the perplexity windows this many at a time, one cache row "
         "each, --score_chunk positions per row per forward: batched decode (a union-scope --expert_budget then caps "
         "the union of every row's experts; give --budget_max_positions >= rows x chunk or 0).", lower_bound=1)
    once(flags.DEFINE_integer, "eval_seed", 1234, "Seed for picking windows, items and distractors.")
    once(flags.DEFINE_string, "output_json", "", "Also write the results as JSON.")
    once(flags.DEFINE_boolean, "check_contract", False, "Instead of the quality eval: greedy generation with and "
         "without MTP drafts for the given plugins (--plugin, --expert_budget, ...): identical or not (exit status "
         "0 / 1), and each plugin's kind (routing-only or cache-dependent, row-independent).")
    once(flags.DEFINE_integer, "contract_tokens", 32, "--check_contract: tokens to generate.", lower_bound=1)
    once(flags.DEFINE_string, "contract_prompt", "ROMEO:\n", "--check_contract: the prompt (comma-separated token "
         "ids for a model without a tokenizer).")
    O.define_eval_flags()


def verdict(r: dict, limits: dict):
    """(passed, the verdict line) of an eval's results against the thresholds (options.EVAL_OPTIONS)."""
    checks = [("perplexity", f"{100 * (r['ppl'] / r['ppl_ref'] - 1):+.1f}% (<= +{100 * limits['max_ppl_increase']:g}%)",
               r["ppl"] <= r["ppl_ref"] * (1 + limits["max_ppl_increase"])),
              ("KL", f"{r['kl']:.4f} (<= {limits['max_kl']:g})", r["kl"] <= limits["max_kl"]),
              ("top-1", f"{r['top1_agree']:.3f} (>= {limits['min_top1']:g})", r["top1_agree"] >= limits["min_top1"])]
    if r.get("mc_items"):
        drop = r["mc_acc_norm_ref"] - r["mc_acc_norm"]
        checks.append(("MC acc_norm", f"{-drop:+.3f} (>= -{limits['max_mc_drop']:g})", drop <= limits["max_mc_drop"]))
    failed = [name for name, _, c in checks if not c]
    return not failed, f"verdict: {'FAIL' if failed else 'PASS'}: " + \
        ", ".join(f"{name} {text}" for name, text, _ in checks) + (f"; failed: {', '.join(failed)}" if failed else "")


# ----------------------------------------------------------------------------- math (tested)
def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, cfg_logits: np.ndarray) -> np.ndarray:
    """KL(ref || cfg) per position, natural log."""
    lp, lq = log_softmax(ref_logits), log_softmax(cfg_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    """exp(mean NLL) of targets[t] under logits[t]."""
    lp = log_softmax(logits)
    nll = -lp[np.arange(len(targets)), targets]
    return float(np.exp(nll.mean()))


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).mean())


def mc_accuracy(scores: list, answers: list) -> float:
    """scores: per item a list of candidate scores; answers: index of the true candidate."""
    return float(np.mean([int(np.argmax(s) == a) for s, a in zip(scores, answers)]))


# ----------------------------------------------------------------------------- data
def read_plays(path: str) -> dict:
    plays, cur = {}, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("=== ") and line.rstrip().endswith(" ==="):
                cur = line.strip()[4:-4].strip()
                plays[cur] = []
            elif cur is not None:
                plays[cur].append(line.rstrip("\n"))
    if len(plays) < 2:
        raise ValueError(f"{path}: expected at least 2 plays separated by '=== name ===' lines")
    return plays


def make_items(plays: dict, n_items: int, context_lines: int, seed: int) -> list:
    """Next-line multiple choice: (context, [candidates], answer index)."""
    rng = random.Random(seed)
    good = {p: [l for l in ls] for p, ls in plays.items()}
    names = sorted(good)
    items = []
    tries = 0
    while len(items) < n_items and tries < n_items * 50:
        tries += 1
        p = rng.choice(names)
        ls = good[p]
        i = rng.randrange(context_lines, len(ls))
        true = ls[i]
        ctx = ls[i - context_lines:i]
        if len(true.strip()) < 12 or not all(c.strip() for c in ctx):
            continue
        others = [q for q in names if q != p]
        distract = []
        while len(distract) < 3:
            q = rng.choice(others)
            d = rng.choice(good[q])
            if len(d.strip()) >= 12 and d != true and d not in distract:
                distract.append(d)
        cands = distract + [true]
        rng.shuffle(cands)
        items.append(("\n".join(ctx) + "\n", [c + "\n" for c in cands], cands.index(true)))
    return items


def make_windows(tok, plays: dict, n: int, length: int, seed: int) -> list:
    rng = random.Random(seed + 1)
    ids = {p: tok.encode("\n".join(ls)) for p, ls in plays.items()}
    names = sorted(ids)
    out = []
    for k in range(n):
        p = names[k % len(names)]
        a = ids[p]
        s = rng.randrange(0, max(1, len(a) - length - 1))
        out.append(a[s:s + length])
    return out


# ----------------------------------------------------------------------------- scoring through the cache
class Scorer:
    """Teacher-forced logits via the engine's KV cache, ``chunk`` positions per forward, batch 1."""

    def __init__(self, engine, chunk: int):
        self.e = engine
        self.chunk = chunk

    def run(self, ids: list, start: int = 0) -> np.ndarray:
        """Logits [len(ids), V] of ids placed at positions start.. (the cache before ``start`` is reused)."""
        e = self.e
        out = []
        for s in range(0, len(ids), self.chunk):
            part = ids[s:s + self.chunk]
            toks = np.zeros((1, self.chunk), np.int32)
            toks[0, : len(part)] = part
            lg, _ = e.forward(toks, np.array([start + s], np.int32), np.array([len(part)], np.int32))
            out.append(np.asarray(lg)[0, : len(part)])
        return np.concatenate(out)

    def prepare(self, need: int, rows: int = 1):
        self.e._ensure_cache(rows, need + self.chunk)

    def run_batch(self, seqs: list) -> list:
        """Logits of several equal-length sequences decoded together, one per cache row: each forward carries
        ``chunk`` positions of every row, as batched decode does (a union-scope EXPERT_BUDGET then caps the union of
        all rows' experts)."""
        e = self.e
        B, n = len(seqs), len(seqs[0])
        out = [[] for _ in seqs]
        for s in range(0, n, self.chunk):
            m = min(self.chunk, n - s)
            toks = np.zeros((B, self.chunk), np.int32)
            for b, q in enumerate(seqs):
                toks[b, :m] = q[s:s + m]
            lg, _ = e.forward(toks, np.full(B, s, np.int32), np.full(B, m, np.int32))
            lg = np.asarray(lg)
            for b in range(B):
                out[b].append(lg[b, :m])
        return [np.concatenate(o) for o in out]


def evaluate(engine, ref, plays: dict, n_items=200, n_windows=16, window_len=128, context_lines=6, chunk=4,
             seed=1234, batch: int = 1) -> dict:
    """Quality of ``engine`` against ``ref``.  ``batch`` > 1 scores the windows ``batch`` at a time, one cache row
    each, ``chunk`` positions per row per forward (batched decode; the MC items stay at batch 1)."""
    tok = engine.tokenizer
    engine._route_acc, ref._route_acc = {}, {}
    if engine.store is not None:
        engine.store.reset_stats()
    sc, sr = Scorer(engine, chunk), Scorer(ref, chunk)
    t0 = time.perf_counter()
    # perplexity / KL / agreement on windows
    nll_c, nll_r, kls, agree = [], [], [], []
    memo = ref.__dict__.setdefault("_eval_memo", {})
    keep = n_windows * window_len * engine.cfg.vocab_size * 4 <= 512e6      # memoise up to 512 MB of logits
    wins = make_windows(tok, plays, n_windows, window_len, seed)
    batched = {}
    if batch > 1:
        for g in range(0, len(wins), batch):
            grp = wins[g:g + batch]
            sc.prepare(len(grp[0]), len(grp))
            for w, lc in zip(grp, sc.run_batch(grp)):
                batched[tuple(w)] = lc
        sc.prepare(len(wins[0]))
    for w in wins:
        if batch > 1:
            lc = batched[tuple(w)]
        else:
            sc.prepare(len(w))
            lc = sc.run(w)
        wkey = ("window", tuple(w), chunk)          # the reference's logits do not depend on the config
        lr = memo.get(wkey)
        if lr is None:
            sr.prepare(len(w))
            lr = sr.run(w)
            if keep:
                memo[wkey] = lr
        tgt = np.asarray(w[1:])
        nll_c.append(-log_softmax(lc[:-1])[np.arange(len(tgt)), tgt])
        nll_r.append(-log_softmax(lr[:-1])[np.arange(len(tgt)), tgt])
        kls.append(kl_divergence(lr, lc))
        agree.append(lc.argmax(-1) == lr.argmax(-1))
    res = {"ppl": float(np.exp(np.concatenate(nll_c).mean())), "ppl_ref": float(np.exp(np.concatenate(nll_r).mean())),
           "kl": float(np.concatenate(kls).mean()), "top1_agree": float(np.concatenate(agree).mean())}
    # multiple choice (the reference's numbers are memoised on the engine: they do not depend on the config)
    items = make_items(plays, n_items, context_lines, seed) if n_items > 0 else []
    key = ("mc", n_items, context_lines, chunk, seed, n_windows, window_len)
    for name, s in (("", sc), ("_ref", sr)) if items else ():
        if name and key in memo:
            res.update(memo[key])
            continue
        acc, accn, accp = [], [], []
        null = tok.encode("\n")
        for ctx, cands, ans in items:
            cids = tok.encode(ctx)
            cand_ids = [tok.encode(c) for c in cands]
            s.prepare(len(cids) + max(len(c) for c in cand_ids))
            tot, mean, uncond = [], [], []
            for prefix, dest in ((cids, None), (null, uncond)):
                last = s.run(prefix)[-1]
                for c in cand_ids:
                    lc = s.run(c[:-1], start=len(prefix)) if len(c) > 1 else np.zeros((0, last.shape[-1]))
                    lp = log_softmax(np.concatenate([last[None], lc]))[np.arange(len(c)), c]
                    if dest is None:
                        tot.append(lp.sum())
                        mean.append(lp.mean())
                    else:
                        dest.append(lp.sum())
            acc.append(int(np.argmax(tot) == ans))
            accn.append(int(np.argmax(mean) == ans))
            accp.append(int(np.argmax(np.array(tot) - np.array(uncond)) == ans))    # PMI: context relevance
        out = {"mc_acc" + name: float(np.mean(acc)), "mc_acc_norm" + name: float(np.mean(accn)),
               "mc_acc_pmi" + name: float(np.mean(accp))}
        res.update(out)
        if name:
            memo[key] = out
    res["mc_items"] = len(items)
    res["ppl_delta_pct"] = 100.0 * (res["ppl"] / res["ppl_ref"] - 1.0)
    res["eval_s"] = time.perf_counter() - t0
    res.update(route_stats(engine._route_acc))
    return res


# ----------------------------------------------------------------------------- MTP contract check
def check_contract(model, opts: dict, prompt="ROMEO:\n", new_tokens: int = 32, probe_seeds: int = 4) -> dict:
    """Greedy generation with the configuration's plugins, with and without MTP drafts, and each plugin's kind.

    Returns {"identical", "first_diff" (token index or None), "tokens", "tokens_mtp", "mtp_acceptance",
    "experts_dropped" (without MTP), "draft", "plugins": [{"name", "kind", "cache_dependent", "row_independent",
    "value_flags", "mtp_safe"}]}; the last plugin row is the whole composition (built-in flags included) as the
    engine runs it, unless it is a single user plugin alone."""
    opts = O.resolve(opts)
    eng = Engine.load(model, **dict(opts, mtp=True))
    if eng.params.get("mtp") is None:
        raise GlmJaxError(f"{eng.path}: --check_contract needs a model with an MTP layer")
    if not eng.lossy:
        raise GlmJaxError("--check_contract: no routing plugin given (--plugin, --expert_topp, --expert_budget, "
                          "--cache_route)")
    if isinstance(prompt, str) and eng.tokenizer is None:
        try:
            prompt = [int(t) for t in prompt.split(",") if t.strip()]
        except ValueError:
            raise GlmJaxError(f"{eng.path}: no tokenizer.json; give --contract_prompt as comma-separated token "
                              "ids") from None
    draft = opts["draft"] if opts["draft"] > 0 else 3

    def run(**spec_opts):
        # the speculative options are read per generate call: one engine (one set of compiled programs) runs both;
        # each run starts from an empty expert cache
        saved = dict(eng.opts)
        eng.opts.update(spec_opts)
        if eng.store is not None:
            eng.store.drop_cache(page_cache=False)
        try:
            return eng.generate(prompt, max_new_tokens=new_tokens, temperature=0.0, stop_on_eos=False)
        finally:
            eng.opts.clear()
            eng.opts.update(saved)

    a = run(draft=0)
    b = run(draft=draft, draft_source="mtp")
    eng.close()
    diff = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    if diff is None and len(a.tokens) != len(b.tokens):
        diff = min(len(a.tokens), len(b.tokens))
    cfg = eng.cfg
    layers = list(cfg.moe_layers) + [cfg.num_hidden_layers]
    probe = dict(K=cfg.num_experts_per_tok, E=cfg.n_routed_experts, layers=layers,
                 norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
                 num_layers=cfg.num_hidden_layers, seeds=probe_seeds)
    rows = []
    user = O.load_plugins(opts["plugins"])
    for fn, name in user + [(eng.plugin, "all, as composed" if user else eng.plugin.name)]:
        if fn is eng.plugin and len(user) == 1 and _no_builtin(opts):
            continue                                   # one user plugin alone: the composition is that plugin
        c = effective_kind(P.contract.classify(fn, **probe), eng)
        rows.append(dict(name=name, **c, mtp_safe=not c["cache_dependent"] and c["row_independent"]))
    return {"identical": diff is None, "first_diff": diff, "tokens": a.tokens, "tokens_mtp": b.tokens,
            "mtp_acceptance": b.stats.get("mtp_acceptance", 0.0), "experts_dropped": a.stats["experts_dropped"],
            "draft": draft, "plugins": rows}


def effective_kind(c: dict, engine) -> dict:
    """A plugin that reads ``resident`` is still routing-only in an engine whose residency is static (no store, or
    --budget_residency none / pinned): the probe varies the mask, that engine never does."""
    if c["cache_dependent"] and engine.residency_is_static:
        c = dict(c, cache_dependent=False,
                 kind=f"routing-only (resident constant: --budget_residency={engine.opts['budget_residency']})")
    return c


def _no_builtin(opts) -> bool:
    return opts["expert_topp"] >= 1.0 and opts["expert_budget"] <= 0 and opts["cache_route"] == "off"


def contract_report(r: dict) -> str:
    out = ["| plugin | kind | row-independent | value checks on probes | keeps MTP's contract (predicted) |",
           "|---|---|---|---|---|"]
    for p in r["plugins"]:
        out.append(f"| {p['name']} | {p['kind']} | {'yes' if p['row_independent'] else 'no'} | "
                   f"{describe(p['value_flags']) or 'ok'} | {'yes' if p['mtp_safe'] else 'no'} |")
    n = len(r["tokens"])
    if r["identical"]:
        verdict = f"PASS: greedy output with MTP (draft {r['draft']}) is identical to without, {n} tokens"
    else:
        verdict = (f"FAIL: greedy output with MTP (draft {r['draft']}) differs from without at token "
                   f"{r['first_diff']} of {n}")
    verdict += f" (MTP acceptance {100 * r['mtp_acceptance']:.0f}%)"
    safe = all(p["mtp_safe"] for p in r["plugins"])
    if r["identical"] and not safe:
        verdict += "; identical on this prompt, but a plugin is cache-dependent or cross-row: not guaranteed"
    elif not r["identical"] and safe:
        verdict += "; unexpected for routing-only, row-independent plugins"
    elif not r["identical"]:
        verdict += "; expected: a plugin is cache-dependent or cross-row"
    return "\n".join(out) + "\n" + verdict


def main(argv):
    from absl import logging

    if not FLAGS["verbosity"].present:       # keep jax's backend-probe INFO lines off the terminal
        logging.set_verbosity(logging.WARNING)
    if FLAGS.check_contract:
        try:
            r = check_contract(FLAGS.model or None, O.from_flags(), FLAGS.contract_prompt, FLAGS.contract_tokens)
        except GlmJaxError as e:
            print(f"glm-jax-eval: error: {e}", file=sys.stderr)
            return 2
        print(contract_report(r))
        if not _write_output(r):
            return 2
        return 0 if r["identical"] else 1
    try:
        opts = O.from_flags()
        limits = O.eval_from_flags()
        if FLAGS.output_json:           # before the evaluation, so that its result is never lost at the end
            O.check_writable(FLAGS.output_json, "--output_json")
        engine = Engine.from_options(FLAGS.model or None, opts)
        ref_opts = dict(opts, expert_topp=1.0, expert_budget=0, cache_route="off", plugins=())
        ref = Engine.load(FLAGS.model or None, **ref_opts)
        text = FLAGS.text or os.path.join(engine.path, "heldout.txt")
        if not os.path.exists(text):
            raise GlmJaxError(f"flag --text: {text} not found (held-out plays, '=== name ===' separated)")
        if engine.tokenizer is None:
            raise GlmJaxError(f"{engine.path}: the eval needs tokenizer.json")
        plays = read_plays(text)
        positions = sum(max(0, len(ls) - FLAGS.context_lines) for ls in plays.values())
        if FLAGS.items > positions:
            raise GlmJaxError(f"flag --items={FLAGS.items}: {text} has {positions} next-line positions at "
                              f"--context_lines={FLAGS.context_lines}; use --items <= {positions} (items beyond "
                              f"them would only repeat)")
    except (GlmJaxError, ValueError) as e:
        print(f"glm-jax-eval: error: {e}", file=sys.stderr)
        return 2
    r = evaluate(engine, ref, plays, FLAGS.items, FLAGS.windows, FLAGS.window_len, FLAGS.context_lines,
                 FLAGS.score_chunk, FLAGS.eval_seed, batch=FLAGS.eval_batch)
    lossy = {k: v for k, v in opts.items() if k in ("expert_topp", "expert_budget", "budget_scope",
                                                     "budget_residency", "cache_route") and v != O.BY_NAME[k].default}
    if engine.plugin_names:
        lossy["plugins"] = engine.plugin_names
    print(f"config: {lossy or 'no lossy plugin'}  (model {engine.path}, score_chunk {FLAGS.score_chunk})")
    print("| metric | config | reference |")
    print("|---|---|---|")
    print(f"| perplexity | {r['ppl']:.3f} | {r['ppl_ref']:.3f} |")
    print(f"| KL(ref‖config) /token | {r['kl']:.4f} | 0 |")
    print(f"| top-1 agreement | {r['top1_agree']:.4f} | 1 |")
    if r["mc_items"]:
        print(f"| next-line MC acc ({r['mc_items']} items) | {r['mc_acc']:.3f} | {r['mc_acc_ref']:.3f} |")
        print(f"| next-line MC acc_norm | {r['mc_acc_norm']:.3f} | {r['mc_acc_norm_ref']:.3f} |")
        print(f"| next-line MC acc_pmi | {r['mc_acc_pmi']:.3f} | {r['mc_acc_pmi_ref']:.3f} |")
    print(f"| experts dropped | {int(r['experts_dropped'])} | 0 |")
    ok, line = verdict(r, limits)
    print(line)
    r["verdict"] = "pass" if ok else "fail"
    if not _write_output(r):
        return 2
    return 0 if ok else 1


def _write_output(r: dict) -> bool:
    """--output_json (if given) <- r; False after its one error line."""
    if FLAGS.output_json:
        try:
            O.write_json_output(FLAGS.output_json, r)
        except GlmJaxError as e:
            print(f"glm-jax-eval: error: {e}", file=sys.stderr)
            return False
    return True


EVAL_FLAGS = ("model", "text", "items", "windows", "window_len", "context_lines", "score_chunk", "eval_batch",
              "eval_seed", "output_json", "check_contract", "contract_tokens", "contract_prompt", "max_ppl_increase",
              "max_kl", "min_top1", "max_mc_drop")


def help_text() -> str:
    return O.command_help(FLAGS, [__doc__.strip().split("\n\n")[0], ""], O.main_flag_names(EVAL_FLAGS),
                          "glm-jax-eval --helpfull documents every flag.")


def run():
    define_flags()
    O.define_flags()
    # a bad flag: one `glm-jax-eval: error:` line, exit 2 (absl's own handler printed two)
    app.run(main, flags_parser=lambda argv: O.parse_command_flags(FLAGS, argv, "glm-jax-eval", help_text))


if __name__ == "__main__":
    run()
