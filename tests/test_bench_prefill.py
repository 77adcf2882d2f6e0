"""The benches' prefill rates come from a cold prefill (tools/bench/peer.py cold_generate): the scheduler's prefix
cache must not hand a timed run the K/V of the previous run of the same prompt."""

import glm_jax

from tools.bench import peer as P


def test_a_timed_run_prefills_the_whole_prompt_every_time():
    eng = glm_jax.Engine.load()                     # the embedded model
    prompt = list(range(5, 21))
    try:
        eng.generate(prompt, max_new_tokens=2, stop_on_eos=False)
        again = eng.generate(prompt, max_new_tokens=2, stop_on_eos=False)
        assert again.stats["cached_tokens"] == 15    # what the benches timed before: a one-token prefill
        for _ in range(2):
            r = P.cold_generate(eng, prompt, 2)
            assert r.stats["cached_tokens"] == 0 and r.stats["prefill_tokens"] == 16
    finally:
        eng.close()
