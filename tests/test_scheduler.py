"""The scheduler's decode widths (they follow the running rows) and what they must not change: a row's numbers are
bitwise the same at every width, so a request's greedy output is the same alone (width 1) or beside others.
One engine (the shipped model, 8 rows) for the module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm_jax
from glm_jax import model as M
from glm_jax.runtime import scheduler as S
from glm_jax.runtime.runner import BIG_POS

ROMEO = "ROMEO:\n"


@pytest.fixture(scope="module")
def eng():
    e = glm_jax.Engine.load(max_batch=8, prefill_chunk=16)
    yield e
    e.close()


def test_a_rows_logits_are_bitwise_the_same_at_every_width(eng):
    """model.step on one decode row beside 0, 1, 3 or 7 others (padding rows, or rows with other contents): the
    row's logits are bitwise equal.  Before model.row_sum (XLA's reductions in rms_norm / softmax change their
    order with the row count) and the one-row router pad, widths 1 and 4 differed in the last bits."""
    cfg, p, res = eng.cfg, eng.step_params(), eng._resident_masks()
    ids = eng.encode("ROMEO:\nWhat say you, my lord")
    P = len(ids)
    step = jax.jit(lambda p, c, t, s, l: M.step(cfg, p, c, t, s, l, res)[:3])
    cache = M.init_cache(cfg, 1, 64, eng.dtype, with_mtp=eng.params.get("mtp") is not None)
    toks = np.zeros((1, 16), np.int32)
    toks[0, :P] = ids
    lg, _, cache = step(p, cache, jnp.asarray(toks), jnp.array([0], jnp.int32), jnp.array([P], jnp.int32))
    nxt = int(np.argmax(np.asarray(lg[0, P - 1])))
    rng = np.random.default_rng(0)
    got = {}
    for w in (1, 2, 4, 8):
        for pad in (True, False):
            c = [{k: jnp.concatenate([v, jnp.asarray(rng.standard_normal((w - 1,) + v.shape[1:]), v.dtype)])
                  for k, v in d.items()} for d in cache]
            t = np.zeros((w, 4), np.int32)                    # the scheduler's decode width: 4 columns, 1 real
            t[:, 0] = nxt
            t[1:, 0] = rng.integers(0, cfg.vocab_size, w - 1)
            start = np.full(w, P, np.int32)
            n = np.ones(w, np.int32)
            if pad:
                start[1:], n[1:] = BIG_POS, 0
            else:
                start[1:] = rng.integers(1, 60, w - 1)
            out = step(p, c, jnp.asarray(t), jnp.asarray(start), jnp.asarray(n))[0]
            got[w, pad] = np.asarray(out[0, 0])
    ref = got[1, True]
    for k, v in got.items():
        assert np.array_equal(v, ref), k


def test_a_lone_request_runs_at_width_1_and_matches_beside_others(eng):
    """Alone, a request decodes at width 1 (not max_batch 8); beside 3 others at width 4; its greedy tokens (and a
    sampled one's, seeded) are the same either way, and the same as a max_batch 1 engine's."""
    sched = eng.scheduler
    widths = []
    real = sched.decode_rows

    def spy(rows, W):
        m = real(rows, W)
        widths.append(sched.B if m is None else len(m))
        return m
    sched.decode_rows = spy
    try:
        prompts = [ROMEO, "JULIET:\n", "To be, or not", "KING HENRY:\nOnce more"]
        alone = [eng.generate(p, max_new_tokens=40).tokens for p in prompts]
        assert set(widths) == {1}
        widths.clear()
        together = [r.tokens for r in eng.generate(prompts, max_new_tokens=40)]
        assert 4 in widths and 8 not in widths
        assert together == alone
        kw = dict(max_new_tokens=40, temperature=0.9, top_p=0.9, top_k=20, seed=7)
        assert [r.tokens for r in eng.generate(prompts, **kw)] == [eng.generate(p, **kw).tokens for p in prompts]
    finally:
        del sched.decode_rows
    one = glm_jax.Engine.load(max_batch=1, prefill_chunk=16)
    try:
        assert [one.generate(p, max_new_tokens=40).tokens for p in prompts] == alone
    finally:
        one.close()


def _chat(eng, turns, prefix_cache):
    """A multi-turn chat: every turn resends the whole history (as chat clients do); returns each turn's
    (tokens, cached_tokens)."""
    sched = eng.scheduler
    sched.prefix_cache = prefix_cache
    hist, out = [], []
    for u in turns:
        hist.append({"role": "user", "content": u})
        r = eng.generate(hist, chat=True, max_new_tokens=12)
        out.append((r.tokens, r.stats["cached_tokens"]))
        hist.append({"role": "assistant", "content": r.text})
    return out


def test_prefix_cache_reuses_a_finished_rows_kv_with_the_same_output(eng):
    """Each turn of a chat starts with the previous turn's prompt + reply: with the prefix cache it is admitted
    into that row and prefills only the rest; greedy tokens identical to prefilling everything."""
    turns = ["Who are you?", "Speak of love.", "And of death?", "Farewell."]
    try:
        off = _chat(eng, turns, False)
        on = _chat(eng, turns, True)
    finally:
        eng.scheduler.prefix_cache = True
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(c == 0 for _, c in off)
    assert all(c > 0 for _, c in on[1:])
    # a prompt that diverges reuses only the common part; another caller's writes to the cache forget the rows
    eng.generate(ROMEO + "Hark", max_new_tokens=4)
    r = eng.generate(ROMEO + "Soft", max_new_tokens=4)
    assert 0 < r.stats["cached_tokens"] < len(r.prompt_tokens)
    eng.batch_logits([[1, 2, 3]] * 8)
    saved, eng.scheduler.saved = eng.scheduler.saved, None      # the rows alone (the host copies are another level)
    try:
        again = eng.generate(ROMEO + "Soft", max_new_tokens=4)
    finally:
        eng.scheduler.saved = saved
    assert again.stats["cached_tokens"] == 0 and again.tokens == r.tokens


def test_a_short_suffix_prefills_at_4_rows_with_the_tokens_of_a_full_prefill(eng):
    """A prefix hit with 1-4 new tokens prefills them at SHORT_PREFILL (4) rows instead of the 16-row bucket (the
    padding rows' attention and dense products were most of a 1-token prefill's time, the TTFT of a chat turn's
    resend): its logits' first row, and so the greedy tokens, are those of prefilling the whole prompt."""
    sched = eng.scheduler
    base = eng.encode("ROMEO:\nBut soft, what light through yonder window breaks?")
    eng.generate(base, max_new_tokens=2, stop_on_eos=False)
    widths = []
    forward = sched.rt.forward
    try:
        sched.rt.forward = lambda toks, *a, **k: widths.append(toks.shape[1]) or forward(toks, *a, **k)
        for extra in ([5], [5, 6, 7]):
            sched.prefix_cache = True
            hit = eng.generate(base + extra, max_new_tokens=8, stop_on_eos=False)
            assert hit.stats["cached_tokens"] >= len(base) and widths[-1] == S.SHORT_PREFILL
            sched.prefix_cache = False
            full = eng.generate(base + extra, max_new_tokens=8, stop_on_eos=False)
            assert full.stats["cached_tokens"] == 0 and full.tokens == hit.tokens
    finally:
        sched.rt.forward = forward
        sched.prefix_cache = True


def test_prefix_store_gives_back_a_taken_rows_kv_from_host_ram():
    """One row: every new prompt rewrites it.  What it held is copied to the prefix store first, so a later
    request for an earlier prompt (or its continuation) prefills only its new tokens, with the greedy tokens of a
    full prefill; the store stays within --prefix_store_mb, least recently used first out.  Before it (the rows
    only), the repeated prompt prefilled everything (cached_tokens 0)."""
    texts = ["ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is the sun.",
             "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.",
             "KING HENRY:\nOnce more unto the breach, dear friends, once more, or close the wall up."]
    eng = glm_jax.Engine.load(max_batch=1, prefill_chunk=16, prefix_store_mb=1.0)
    try:
        sched = eng.scheduler
        rt, put, written = sched.rt, sched.rt.put_row, []

        def put_row(part, row):                   # the restores' lengths: buckets of 64 (or the whole row), not
            written.append(int(jax.tree_util.tree_leaves(part)[0].shape[1]))   # each entry's own (one program each)
            return put(part, row)
        rt.put_row = put_row
        first = [eng.generate(t, max_new_tokens=8) for t in texts]
        assert len(sched.saved) == 2 and 0 < sched.saved.bytes <= 1e6     # the last one is still in the row
        again = eng.generate(texts[0], max_new_tokens=8)
        assert again.tokens == first[0].tokens
        assert again.stats["cached_tokens"] == len(again.prompt_tokens) - 1
        longer = eng.generate(texts[1] + " Speak.", max_new_tokens=8)
        assert longer.stats["cached_tokens"] >= len(first[1].prompt_tokens) - 1
        sched.prefix_cache = False
        full = eng.generate(texts[1] + " Speak.", max_new_tokens=8)
        assert full.stats["cached_tokens"] == 0 and full.tokens == longer.tokens
        sched.prefix_cache = True
        assert len(written) == 2 and all(n % 64 == 0 or n == rt._cache_len for n in written), written
        # the bound: room for one entry of these lengths -> saving the second pushes the first out
        one = max(nb for _, _, nb in sched.saved.entries.values())
        sched.saved.clear()
        sched.saved.max_bytes = one + one // 4
        for t in texts:
            eng.generate(t, max_new_tokens=8)
        assert len(sched.saved) == 1 and sched.saved.bytes <= sched.saved.max_bytes
        assert sched.saved.counters["evicted"] >= 1
        (toks, _, _), = sched.saved.entries.values()
        assert list(toks[:len(first[1].prompt_tokens)]) == first[1].prompt_tokens
    finally:
        eng.close()


def test_a_request_nobody_streams_runs_whole_dispatches(eng, monkeypatch):
    """With the native stream sink, a request nobody streams (Engine.generate, a non-streamed server request) runs
    the in-loop hand-off too, so its dispatch is not cut to what fits in --dispatch_ms: the host still sees each
    step (a cancel, a stop string, a newcomer end the loop), and the KV window's copy and the host's turn are paid
    once a dispatch instead of once a token (the GLM-4.5-Air slice: a 35 ms step against the 50 ms default ran one
    step a dispatch).  Same greedy tokens."""
    ref = eng.generate(ROMEO, max_new_tokens=24, stop_on_eos=False)
    sched = eng.scheduler
    if sched._native_sink() is None:
        pytest.skip("no native stream sink (kernels not built)")
    monkeypatch.setattr(sched, "step_s", 0.02)                 # as if each decode step took 20 ms ...
    monkeypatch.setattr(sched, "observe_step", lambda s: None)  # ... so 2 steps would fit in 50 ms
    assert sched.dispatch_s == 0.05 and sched.steps_per_dispatch() == 2
    d0 = sched.counters["dispatches"]
    req = eng.request(ROMEO, max_new_tokens=24, stop_on_eos=False)
    sched.submit(req)
    sched.run([req])
    assert req.out == ref.tokens
    assert sched.counters["dispatches"] - d0 == 1


def test_tokens_stream_one_by_one_from_inside_a_dispatch(eng):
    """--stream_interval=1 (default): a streamed request gets each token as it is sampled, while the fused loop
    keeps running (fewer dispatches than tokens); --stream_interval=4: 4 at a time; same tokens as not streamed.
    A cancel or a stop string seen by the host stops the row inside the running dispatch, and no token after it is
    delivered."""
    sched = eng.scheduler
    # the step time is measured: a dispatch is timed only where its program had compiled before, so a second run
    # (run alone, with -k, the first one's windows compiled there; the file's earlier tests had hidden that)
    ref = eng.generate(ROMEO, max_new_tokens=48, stop_on_eos=False)
    assert eng.generate(ROMEO, max_new_tokens=48, stop_on_eos=False).tokens == ref.tokens
    assert sched.step_s is not None
    try:
        sched.dispatch_s = 60.0                                           # dispatches of 32 steps, whatever the load
        assert sched.steps_per_dispatch() == 32
        for every, size in ((1, 1), (4, 4)):
            sched.stream_interval = every
            sizes = []
            d0 = sched.counters["dispatches"]
            req = eng.request(ROMEO, max_new_tokens=48, stop_on_eos=False,
                              on_event=lambda r, text, toks, done: sizes.append(len(toks)) if toks else None)
            sched.submit(req)
            sched.run([req])
            assert req.out == ref.tokens
            assert sched.counters["dispatches"] - d0 < 48 / 4
            # the loop never waits for the host: a host thread slower than the steps (a loaded machine) takes
            # several steps' tokens at once, always whole intervals (but the first, from the prefill, and the last);
            # more events than dispatches: they came from inside the running loop.  (Not "some event holds exactly
            # one interval": on a loaded machine the host thread took [1, 32, 10, 5] in a CI run, 2026-12-04.)
            assert sum(sizes) == 48, sizes
            assert all(k % size == 0 for k in sizes[1:-1]), sizes
            assert len(sizes) > sched.counters["dispatches"] - d0 + 1, sizes
        sched.stream_interval = 1
        seen = []

        def cancel_at_5(r, text, toks, done):
            seen.extend(toks)
            if len(seen) >= 5:
                sched.cancel(r)
        req = eng.request(ROMEO, max_new_tokens=48, stop_on_eos=False, on_event=cancel_at_5)
        sched.submit(req)
        sched.run([req])
        # (the chunk that reached 5 may hold more than one token: the host can be steps behind the loop); stopped
        # by the end of the first 32-step dispatch at the latest (the prefill's token + 32: a host thread that saw
        # nothing until that dispatch ended), nothing delivered after the cancel
        assert req.finish_reason == "cancelled" and req.out == seen and 5 <= len(seen) <= 1 + 32, seen
        stop = eng.decode(ref.tokens[:12])[-3:]
        req = eng.request(ROMEO, max_new_tokens=48, stop_on_eos=False, stop=[stop],
                          on_event=lambda r, text, toks, done: None)
        sched.submit(req)
        sched.run([req])
        assert req.finish_reason == "stop" and req.text == eng.decode(ref.tokens[:12])[:-3]
    finally:
        sched.stream_interval = eng.opts["stream_interval"]
        sched.dispatch_s = eng.opts["dispatch_ms"] / 1000.0


def test_warmup_compiles_what_the_first_requests_need(monkeypatch):
    """glm-jax-serve --warmup (the default): before it, a server's first request at each batch width compiled
    that width's decode program while its client waited (measured on b: TTFT 1.6-3 s for the first requests at 2,
    4, 8 clients, 19.8 s for the first prefix-cache hit).  After Scheduler.warmup(), streamed requests at every
    width, a non-streamed one, a prefix hit (prompts of the warmed length) and a prompt of another prefill bucket
    trace and compile nothing, and the
    warm-up leaves no trace: its counters are cleared and no row offers its K/V as a cached prefix."""
    from glm_jax.runtime.scheduler import Request, Sampling

    e = glm_jax.Engine.load(max_batch=2, prefill_chunk=32)
    try:
        sched = e.scheduler
        comp, wall = sched.warmup(lengths=(8,))
        assert comp > 0 and wall >= comp
        assert not sched.counters and all(not t for t in sched.row_toks)
        c0 = e.compile_s
        ids = e.tokenizer.encode("KING HENRY:\nOnce more unto the breach")[:7]
        assert len(ids) == 7
        for w, streamed in ((1, True), (2, True), (1, False)):
            reqs = [Request(ids + [i + 1], Sampling(max_new_tokens=6, seed=i),
                            on_event=(lambda *a: None) if streamed else None) for i in range(w)]
            for r in reqs:
                sched.submit(r)
            sched.run(reqs)
            assert all(len(r.out) == 6 for r in reqs)
        hit = Request(ids + [1, 2], Sampling(max_new_tokens=4), on_event=lambda *a: None)
        sched.submit(hit)
        sched.run([hit])
        assert hit.cached_tokens == 8
        longer = Request([5 + i for i in range(25)], Sampling(max_new_tokens=4), on_event=lambda *a: None)
        sched.submit(longer)                      # another prefill bucket (32)
        sched.run([longer])
        assert longer.cached_tokens == 0 and len(longer.out) == 4
        # replies long enough to decode into the next attention window (8 + 60 positions > 64), at both widths and
        # not streamed (before, those programs compiled while the clients waited: 1.9 s on b at 8 clients)
        for w, streamed in ((1, True), (2, True), (1, False)):
            reqs = [Request([9 + i] + ids, Sampling(max_new_tokens=60, seed=i, stop_on_eos=False),
                            on_event=(lambda *a: None) if streamed else None) for i in range(w)]
            for r in reqs:
                sched.submit(r)
            sched.run(reqs)
            assert all(len(r.out) == 60 for r in reqs)
        assert e.compile_s == c0, f"{e.compile_s - c0:.2f} s of tracing/compiling after the warm-up"
        # a prefix hit deeper into the prompt than the warm-up's (before, its suffix's prefill ran in another window)
        long_ = [11 + i for i in range(60)]
        for p in (long_, long_ + [1]):               # (one new token: moe_rows 1, as the warm-up's hit)
            c0 = e.compile_s                      # (the 60-token prompt's own two chunks may compile)
            r = Request(p, Sampling(max_new_tokens=2), on_event=lambda *a: None)
            sched.submit(r)
            sched.run([r])
        assert r.cached_tokens >= 60
        assert e.compile_s == c0, f"{e.compile_s - c0:.2f} s of tracing/compiling for a prefix hit"
        # a streamed row decoding one step at a time while a newcomer prefills (its prompt > --prefill_chunk): before,
        # those 1-step dispatches ran another program (unstreamed, its own window) at every width
        a = Request(ids + [3], Sampling(max_new_tokens=40, stop_on_eos=False), on_event=lambda *a: None)
        sched.submit(a)
        sched.step()
        b = Request([7 + i for i in range(33)], Sampling(max_new_tokens=4), on_event=lambda *a: None)
        sched.submit(b)
        steps0, ran = sched.counters["decode_steps"], []
        fused_fn = S._fused_fn
        monkeypatch.setattr(S, "_fused_fn", lambda *args: ran.append(args[1:]) or fused_fn(*args))
        sched.step()                              # b's first chunk, one decode step of a
        assert b.state == "prefill" and sched.counters["decode_steps"] == steps0 + 1
        monkeypatch.setattr(S, "_fused_fn", fused_fn)
        (_, _, window, _, every, _, _), = ran        # the streamed program, in the window of a full dispatch
        assert every == sched.stream_interval and window >= sched._window(int(sched.pos[a.row]) + S.FUSED_CHUNK)
        sched.run([a, b])
        assert len(a.out) == 40 and len(b.out) == 4
        assert e.compile_s == c0, f"{e.compile_s - c0:.2f} s of tracing/compiling after the warm-up"
    finally:
        e.close()


def test_a_request_arriving_while_the_loop_goes_idle_is_not_left_waiting(eng, monkeypatch):
    """serve_forever going idle: a request submitted between its "nothing to do" check and its wait on the lock
    (here: while it hands freed heap back to the OS, ``trim``) must not wait for the wait's timeout.  Before, the
    check ran outside the lock and ``trim`` right after each request, so a client's next request, sent as soon as
    the last one ended, found the loop trimming, its notify was lost and it waited the full 50 ms (measured on b:
    TTFT 80 ms instead of 30).  The lock's wait is instrumented: it must never be entered with work queued."""
    import threading

    sched = eng.scheduler
    waits_while_busy = []

    class Lock(type(sched.lock)):
        def wait(self, timeout=None):
            waits_while_busy.append(sched.busy())
            return super().wait(timeout)

    late = []

    def trim_then_a_request_arrives():
        if not late:
            late.append(eng.request(ROMEO, max_new_tokens=2, stop_on_eos=False))
            sched.submit(late[0])
    monkeypatch.setattr(S, "trim", trim_then_a_request_arrives)
    monkeypatch.setattr(sched, "lock", Lock())
    stop = threading.Event()
    first = eng.request(ROMEO, max_new_tokens=2, stop_on_eos=False)
    sched.submit(first)
    t = threading.Thread(target=sched.serve_forever, args=(stop,), daemon=True)
    t.start()
    try:
        assert first.done_event.wait(120)
        for _ in range(600):
            if late and late[0].done:
                break
            stop.wait(0.1)
        assert late and late[0].done and len(late[0].out) == 2
    finally:
        stop.set()
        t.join(30)
    assert not any(waits_while_busy), waits_while_busy


def test_warmup_leaves_the_kv_cache_at_the_length_its_programs_were_compiled_for(tmp_path):
    """The warm-up's prefill-bucket pass must not grow the K/V cache: a 256- or 512-token prompt made it 512 / 1024
    positions after the decode programs had been compiled for 256, so the first real requests compiled everything
    again (seen on b: 3.5-9.8 s first-token times after the warm-up).  A model with a 1024-position context and
    --prefill_chunk=256: after the warm-up, requests at both widths compile nothing."""
    from glm_jax.runtime.scheduler import Request, Sampling
    from tools.fixtures import synth_model as SM

    SM.write_hf_checkpoint(str(tmp_path / "hf"), SM.tiny_config(max_position_embeddings=1024,
                                                                num_nextn_predict_layers=0), keep_reference=False)
    e = glm_jax.Engine.load(str(tmp_path / "hf"), max_batch=2, prefill_chunk=256)
    try:
        sched = e.scheduler
        sched.warmup(lengths=(8,))
        c0 = e.compile_s
        for w in (1, 2):
            reqs = [Request([3 + i, 4, 5, 6, 7, 8, 9, 10], Sampling(max_new_tokens=6, seed=i),
                            on_event=lambda *a: None) for i in range(w)]
            for r in reqs:
                sched.submit(r)
            sched.run(reqs)
            assert all(len(r.out) == 6 for r in reqs)
        assert e.compile_s == c0, f"{e.compile_s - c0:.2f} s of tracing/compiling after the warm-up"
    finally:
        e.close()


def test_a_servers_kv_cache_is_the_planned_length_so_a_long_turn_recompiles_nothing_else(tmp_path):
    """glm-jax-serve's K/V cache started at 256 positions and grew with the first longer conversation: every program
    compiled for the old length compiled again while clients waited (seen on b: a chat's first turns after the
    cache grew 256 -> 512 took 3-3.5 s instead of 60-100 ms).  A server now allocates the positions the memory plan
    reserved (here the 1024-position context) at its first request: after a 300-token request, a short one at the
    short one's width and window compiles nothing."""
    from glm_jax.runtime.scheduler import Request, Sampling
    from glm_jax.serve.app import Server
    from tools.fixtures import synth_model as SM

    SM.write_hf_checkpoint(str(tmp_path / "hf"), SM.tiny_config(max_position_embeddings=1024,
                                                                num_nextn_predict_layers=0), keep_reference=False)
    e = glm_jax.Engine.load(str(tmp_path / "hf"), max_batch=2, prefill_chunk=256)
    try:
        sched = Server(e).sched

        def run(prompt):
            r = Request(prompt, Sampling(max_new_tokens=6, stop_on_eos=False), on_event=lambda *a: None)
            sched.submit(r)
            sched.run([r])
            assert r.error is None and len(r.out) == 6 and r.cached_tokens == 0, (r.error, len(prompt))
        run([3, 4, 5, 6, 7, 8, 9, 10])
        run([11 + i % 50 for i in range(300)])
        c0 = e.compile_s
        run([12, 4, 5, 6, 7, 8, 9, 10])
        assert e.compile_s == c0, f"{e.compile_s - c0:.2f} s of tracing/compiling for a short request again"
        assert e._cache_len == 1024
    finally:
        e.close()


def test_running_a_request_that_was_never_submitted_is_an_error_not_a_hang(eng):
    """Scheduler.run([req]) without submit(req) stepped an empty loop forever (the request never becomes done)."""
    from glm_jax.errors import GlmJaxError

    req = eng.request(ROMEO, max_new_tokens=2)
    with pytest.raises(GlmJaxError, match="never submitted"):
        eng.scheduler.run([req])
    eng.scheduler.submit(req)
    eng.scheduler.run([req])
    assert req.done and len(req.out) == 2
