import numpy as np
import pytest

from ocriaquant.eval import bootstrap_mean, cer, exact_match, ned, paired_bootstrap


def test_hand_checked_values():
    # kitten -> sitting: substitute k/s, e/i, insert g = 3 edits.
    assert ned("kitten", "sitting") == pytest.approx(3 / 7)
    assert cer("kitten", "sitting") == pytest.approx(3 / 7)
    assert cer("sitting", "kitten") == pytest.approx(3 / 6)
    assert ned("", "") == 0.0 and ned("abc", "") == 1.0 and ned("", "abc") == 1.0
    assert cer("", "") == 0.0 and cer("abc", "") == 1.0 and cer("", "abc") == 1.0
    assert ned("# Title", "# Title") == 0.0
    assert ned("| a | b |", "| a | c |") == pytest.approx(1 / 9)
    assert cer("abcdef", "ab") == pytest.approx(4 / 2)  # CER can exceed 1
    assert exact_match(" x\n", "x") == 1.0 and exact_match("x", "y") == 0.0


def test_bootstrap_mean_interval_contains_mean_and_shrinks():
    rng = np.random.default_rng(1)
    x = rng.normal(0.3, 0.1, size=400)
    ci = bootstrap_mean(x)
    assert ci.low < x.mean() < ci.high and ci.estimate == pytest.approx(x.mean())
    assert ci.high - ci.low == pytest.approx(2 * 1.96 * x.std() / np.sqrt(400), rel=0.15)
    ci_small = bootstrap_mean(x[:25])
    assert ci_small.high - ci_small.low > ci.high - ci.low


def test_paired_bootstrap_detects_shift_that_unpaired_would_miss():
    rng = np.random.default_rng(0)
    difficulty = rng.uniform(0, 1, size=200)  # pages vary a lot
    base = difficulty
    other = difficulty + 0.01 + rng.normal(0, 0.002, size=200)  # small, consistent damage
    ci = paired_bootstrap(base, other)
    assert ci.estimate == pytest.approx(0.01, abs=1e-3) and ci.low > 0.009 and ci.high < 0.011
    same = paired_bootstrap(base, base)
    assert same.low == same.high == 0.0
    assert paired_bootstrap(base, other, seed=3) == paired_bootstrap(base, other, seed=3)


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="same pages"):
        paired_bootstrap([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_mean([])
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_mean([0.1, float("nan")])


def test_eval_summary_names_the_worst_pages_worst_first():
    from ocriaquant.evaluate import WORST_PAGES, EvalReport, PageResult

    neds = [0.1, 0.7, 0.0, 0.3, 0.9, 0.2, 0.5]
    rep = EvalReport("m", "p", "all", "bf16", [PageResult(f"p{i}", n, n, float(n == 0), "") for i, n in enumerate(neds)])
    s = rep.summary()
    assert [w["page"] for w in s["worst_pages"]] == ["p4", "p1", "p6", "p3", "p5"][:WORST_PAGES]
    assert s["worst_page"] == "p4" and s["worst_ned"] == 0.9 and s["ned"] == pytest.approx(sum(neds) / len(neds))
