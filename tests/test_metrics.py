import math

import numpy as np
import pytest

from rpa.metrics import mismatch_metrics


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
