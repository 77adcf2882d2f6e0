"""The quality gate's math (glm-jax-eval) and one small end-to-end run on a fixture model."""

import os

import numpy as np
import pytest

import glm_jax
from glm_jax import evaluate as ev

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "glm4moe_full")


def test_kl_of_a_distribution_with_itself_is_zero_and_positive_otherwise():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 11))
    assert np.allclose(ev.kl_divergence(a, a), 0.0, atol=1e-12)
    b = a + rng.normal(size=a.shape)
    assert (ev.kl_divergence(a, b) > 0).all()
    # KL(p||q) for two known distributions
    p = np.log(np.array([[0.5, 0.5]]))
    q = np.log(np.array([[0.9, 0.1]]))
    want = 0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1)
    assert np.isclose(ev.kl_divergence(p, q)[0], want)


def test_perplexity_of_uniform_and_perfect_predictions():
    V = 7
    assert np.isclose(ev.perplexity(np.zeros((4, V)), np.array([0, 1, 2, 3])), V)
    perfect = np.full((3, V), -1e9)
    t = np.array([2, 5, 1])
    perfect[np.arange(3), t] = 0.0
    assert np.isclose(ev.perplexity(perfect, t), 1.0)


def test_mc_accuracy_of_perfect_and_always_wrong_scorers():
    answers = [0, 3, 1, 2]
    perfect = [[1.0 if i == a else 0.0 for i in range(4)] for a in answers]
    wrong = [[0.0 if i == a else 1.0 for i in range(4)] for a in answers]
    assert ev.mc_accuracy(perfect, answers) == 1.0
    assert ev.mc_accuracy(wrong, answers) == 0.0


def test_items_are_deterministic_and_distractors_come_from_other_plays():
    plays = {"a": [f"alpha line number {i} of play a" for i in range(40)],
             "b": [f"beta line number {i} of play b" for i in range(40)],
             "c": [f"gamma line number {i} of play c" for i in range(40)]}
    it1 = ev.make_items(plays, 50, 2, seed=7)
    it2 = ev.make_items(plays, 50, 2, seed=7)
    assert it1 == it2 and len(it1) == 50
    for ctx, cands, ans in it1:
        play = ctx.split()[0]                       # "alpha" / "beta" / "gamma"
        assert cands[ans].startswith(play)
        assert all(not c.startswith(play) for i, c in enumerate(cands) if i != ans)


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    p = tmp_path_factory.mktemp("h") / "heldout.txt"
    words = "the king and queen of the land are here to see the play tonight with all their court".split()
    rng = np.random.default_rng(1)
    with open(p, "w") as f:
        for play in ("one", "two", "three"):
            f.write(f"=== {play} ===\n")
            for _ in range(30):
                f.write(" ".join(rng.choice(words, size=rng.integers(4, 9))) + "\n")
    return ev.read_plays(str(p))


def test_config_against_itself_has_zero_kl_and_full_agreement(heldout):
    eng = glm_jax.Engine.load(GOLDEN)
    r = ev.evaluate(eng, eng, heldout, n_items=6, n_windows=2, window_len=24, chunk=4)
    assert r["kl"] == pytest.approx(0.0, abs=1e-9)
    assert r["top1_agree"] == 1.0 and r["ppl"] == pytest.approx(r["ppl_ref"])
    assert r["mc_acc"] == r["mc_acc_ref"] and r["mc_items"] == 6


def test_lossy_config_is_measured_against_the_reference(heldout):
    ref = glm_jax.Engine.load(GOLDEN)
    lossy = glm_jax.Engine.load(GOLDEN, expert_budget=1, budget_scope="position", budget_residency="none")
    r = ev.evaluate(lossy, ref, heldout, n_items=6, n_windows=2, window_len=24, chunk=4)
    assert r["kl"] > 0 and r["top1_agree"] < 1.0
    assert r["experts_dropped"] > 0


def test_chunked_scoring_equals_full_forward():
    eng = glm_jax.Engine.load(GOLDEN)
    ids = list(range(10, 33))
    s = ev.Scorer(eng, 4)
    s.prepare(len(ids))
    assert np.abs(s.run(ids) - eng.logits(ids)).max() < 1e-4


def test_batched_scoring_is_batched_decode(heldout):
    """--eval_batch: windows scored side by side, one cache row each.  Lossless, the rows give the logits of batch
    1; a union-scope budget then caps the union of every row's experts (it drops more than one row at a time)."""
    ids = [list(range(10, 26)), list(range(40, 56))]
    eng = glm_jax.Engine.load(GOLDEN)
    s = ev.Scorer(eng, 1)
    s.prepare(16, rows=2)
    both = s.run_batch(ids)
    s.prepare(16)
    for q, lg in zip(ids, both):
        assert np.abs(lg - s.run(q)).max() < 1e-4
    ref = glm_jax.Engine.load(GOLDEN)
    kw = dict(expert_budget=2, budget_scope="union", budget_residency="none", budget_max_positions=0)
    one = ev.evaluate(glm_jax.Engine.load(GOLDEN, **kw), ref, heldout, n_items=0, n_windows=2, window_len=16, chunk=1)
    two = ev.evaluate(glm_jax.Engine.load(GOLDEN, **kw), ref, heldout, n_items=0, n_windows=2, window_len=16, chunk=1,
                      batch=2)
    # this fixture routes top-2: a budget of 2 drops nothing from one position at a time, but caps two rows' union
    assert one["experts_dropped"] == 0 and two["experts_dropped"] > 0


def test_the_verdict_against_thresholds():
    """glm-jax-eval ends with a verdict (before: a table and no verdict): PASS within every threshold, FAIL naming
    the measures outside them; the thresholds are flags with ranges."""
    from glm_jax import options as O

    limits = {o.name: o.default for o in O.EVAL_OPTIONS}
    same = dict(ppl=10.0, ppl_ref=10.0, kl=0.0, top1_agree=1.0, mc_items=4, mc_acc_norm=0.5, mc_acc_norm_ref=0.5)
    ok, line = ev.verdict(same, limits)
    assert ok and line.startswith("verdict: PASS")
    lossy = dict(same, ppl=11.0, kl=0.2, mc_acc_norm=0.4)
    ok, line = ev.verdict(lossy, limits)
    assert not ok and line.endswith("failed: perplexity, KL, MC acc_norm")
    assert ev.verdict(lossy, dict(limits, max_ppl_increase=0.2, max_kl=0.3, max_mc_drop=0.2))[0]
    with pytest.raises(O.OptionError, match="--min_top1"):
        O.check_value(O.EVAL_BY_NAME["min_top1"], 1.5, "flag --min_top1")
