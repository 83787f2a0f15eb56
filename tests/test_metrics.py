import math

import numpy as np
import pytest

from rpa.measure.metrics import mismatch_metrics


def test_hand_computed_values():
    pi = [-1.0, -2.0, -0.5, -3.0]
    mu = [-1.0, -1.5, -0.7, -3.0]
    seq = [0, 0, 1, 1]
    m = mismatch_metrics(pi, mu, seq)
    d = [0.0, -0.5, 0.2, 0.0]
    assert m["tokens"] == 4 and m["sequences"] == 2
    assert m["mean_abs_dlogp"] == pytest.approx(0.7 / 4)
    assert m["max_abs_dlogp"] == pytest.approx(0.5)
    assert m["frac_bitwise_equal"] == 0.5
    assert m["kl_k1"] == pytest.approx(-sum(d) / 4)
    assert m["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4)
    assert m["seq_log_ratio_mean_abs"] == pytest.approx((0.5 + 0.2) / 2)
    assert m["seq_log_ratio_max_abs"] == pytest.approx(0.5)
    # e^-0.5 = 0.61 is outside [0.8, 1.25]; e^0.2 = 1.22 is inside
    assert m["frac_ratio_outside"] == 0.25
    assert m["p99_abs_dlogp"] == pytest.approx(np.quantile(np.abs(d), 0.99))


def test_identical_policies_have_zero_mismatch():
    lp = np.log(np.random.default_rng(0).uniform(0.01, 1, 100))
    m = mismatch_metrics(lp, lp, np.repeat(np.arange(10), 10))
    assert m["mean_abs_dlogp"] == 0 and m["kl_k3"] == 0 and m["frac_bitwise_equal"] == 1


def test_shape_errors():
    with pytest.raises(ValueError):
        mismatch_metrics([0.0], [0.0, 1.0], [0, 0])
    with pytest.raises(ValueError):
        mismatch_metrics([], [], [])


def test_full_kl_hand_computed():
    from rpa.measure.metrics import full_kl

    mu = np.log([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    pi = np.log([[0.25, 0.75, 0.0], [0.2, 0.3, 0.5]])
    kl = full_kl(mu, pi)
    assert kl[0] == pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75))
    assert kl[1] == 0.0
    # μ puts no mass where π is -inf: that entry contributes nothing (not nan)
    assert np.isfinite(full_kl(np.log([[1.0, 0.0]]), np.log([[0.9, 0.0]]))).all()
    with pytest.raises(ValueError):
        full_kl(mu, pi[:1])


def test_full_kl_equals_expected_k1_and_k3():
    from rpa.measure.metrics import full_kl

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, 50))
    mu = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    noisy = logits + rng.normal(scale=0.05, size=logits.shape)
    pi = noisy - np.log(np.exp(noisy).sum(-1, keepdims=True))
    kl = full_kl(mu, pi)[0]
    p = np.exp(mu[0])
    delta = pi[0] - mu[0]
    assert kl > 0
    assert kl == pytest.approx(float(np.sum(p * -delta)))  # E_mu[k1] is the exact KL
    assert kl == pytest.approx(float(np.sum(p * (np.expm1(delta) - delta))))  # E_mu[e^d - 1] = 0 exactly
