"""glm5_next through the Engine (resident experts, the one-jit step, the scheduler): transformers' greedy tokens,
rows reused by later requests (a KDA state starts afresh at position 0), what is refused, the cache's bytes."""

import os

import jax
import numpy as np
import pytest

import glm_jax
from glm_jax import model as M
from glm_jax.errors import GlmJaxError
from glm_jax.model import glm5_next

FIX = os.path.join(os.path.dirname(__file__), "golden", "glm5next")


@pytest.fixture(scope="module")
def eng():
    # prefill chunks of 16 positions (the least): a longer prompt is prefilled in several forwards
    e = glm_jax.Engine.load(FIX, dtype="float32", kv_cache_dtype="float32", prefill_chunk=16)
    yield e
    e.close()


@pytest.fixture(scope="module")
def exp():
    with np.load(os.path.join(FIX, "expected.npz")) as z:
        return {k: z[k] for k in z.files}


def test_logits_match_transformers(eng, exp):
    assert np.abs(np.asarray(eng.logits(exp["input_ids"][0].tolist())) - exp["logits"][0]).max() <= 1e-4


def test_padded_batch_of_two(eng, exp):
    """Two sequences of different lengths in one right-padded forward: each row's logits as transformers' alone
    (the shorter row's padding positions change neither its KDA states nor the other row)."""
    a, b = exp["input_ids"][0].tolist(), exp["input_ids"][1].tolist()
    la, lb = eng.logits([a, b[:7]])
    assert np.abs(np.asarray(la) - exp["logits"][0]).max() <= 1e-4
    assert np.abs(np.asarray(lb) - exp["logits"][1][:7]).max() <= 1e-4


def test_greedy_matches_transformers_and_rows_start_afresh(eng, exp):
    prompt, want = exp["greedy_prompt"].tolist(), exp["greedy_tokens"].tolist()
    first = eng.generate(prompt, max_new_tokens=len(want), temperature=0.0, stop_on_eos=False)
    assert first.tokens == want
    # the same row again, its KDA state left by the first request: a prefill from position 0 starts it afresh
    assert eng.generate(prompt, max_new_tokens=len(want), temperature=0.0, stop_on_eos=False).tokens == want
    both = eng.generate([exp["input_ids"][1].tolist(), prompt], max_new_tokens=len(want), temperature=0.0,
                        stop_on_eos=False)
    assert both[1].tokens == want


def test_chunked_prompt_continues_the_state(eng, exp):
    """A 24-token prompt (the greedy prompt and its first 16 tokens) prefilled as 16 + 8 positions: the KDA states
    carry over from one chunk to the next, and the continuation is transformers' remaining tokens."""
    prompt, want = exp["greedy_prompt"].tolist(), exp["greedy_tokens"].tolist()
    res = eng.generate(prompt + want[:16], max_new_tokens=8, temperature=0.0, stop_on_eos=False)
    assert res.tokens == want[16:]


def test_prefix_reuse_only_of_the_whole_held_sequence(eng, exp):
    """A later turn that extends everything a finished row holds continues from its KDA state (cached_tokens), and
    gives transformers' tokens; one that shares only part of it prefills its whole prompt (never a state that is not
    exactly the shared prefix's)."""
    prompt, want = exp["greedy_prompt"].tolist(), exp["greedy_tokens"].tolist()
    kw = dict(temperature=0.0, stop_on_eos=False)
    assert eng.generate(prompt, max_new_tokens=8, **kw).tokens == want[:8]
    turn = eng.generate(prompt + want[:16], max_new_tokens=8, **kw)      # the row holds prompt + want[:7]
    assert turn.tokens == want[16:] and turn.stats["cached_tokens"] == len(prompt) + 7
    part = eng.generate(exp["input_ids"][0].tolist(), max_new_tokens=1, **kw)   # shares only the 8 prompt tokens
    assert part.stats["cached_tokens"] == 0
    assert part.tokens == [int(np.argmax(exp["logits"][0][-1]))]


def test_cache_bytes(eng, exp):
    cfg = eng.cfg
    eng.logits(exp["input_ids"][0].tolist())
    B, S = eng._cache_batch, eng._cache_len
    state = sum(v.nbytes for c in eng._cache for k, v in c.items() if k in M.STATE_KEYS)
    kv = sum(v.nbytes for c in eng._cache for k, v in c.items() if k not in M.STATE_KEYS)
    assert state == B * glm5_next.state_bytes_per_row(cfg) > 0
    assert kv == B * S * M.kv_bytes_per_token(cfg, 4) > 0


def test_convert_refuses_in_one_line(tmp_path):
    from glm_jax.experts.convert import ConvertError, convert
    with pytest.raises(ConvertError, match="glm5_next") as e:
        convert(FIX, str(tmp_path / "c"), progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "c").exists()


@pytest.mark.parametrize("opt, msg", [({"draft": 2}, "draft"), ({"fetch": "loop"}, "fetch"),
                                      ({"dense_format": "int8_row"}, "dense_format")])
def test_unsupported_options_are_one_line_errors(opt, msg):
    with pytest.raises(GlmJaxError, match=msg) as e:
        glm_jax.Engine.load(FIX, **opt)
    assert "\n" not in str(e.value) and "glm5_next" in str(e.value)
    jax.clear_caches()
