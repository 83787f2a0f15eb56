"""Sampling settings and the split of the trainer-sampler gap by source (rpa.core.sampling), against
vLLM's own truncation and a direct computation."""

import math

import numpy as np
import pytest
import torch

from rpa.core.errors import InputError
from rpa.core.sampling import (SamplingSettings, gap_split, kept_mask, log_kept_mass, processed_logprobs,
                               raw_logprobs, recompute_logprobs, sampler_token)

pytestmark = pytest.mark.unit

SETTINGS = [SamplingSettings(), SamplingSettings(temperature=0.7), SamplingSettings(top_p=0.9),
            SamplingSettings(temperature=0.7, top_p=0.9), SamplingSettings(top_k=5),
            SamplingSettings(temperature=0.6, top_p=0.8, top_k=20), SamplingSettings(top_p=1e-6)]


def _logits(rows=64, vocab=512, seed=0, scale=4.0, bf16=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    return x.bfloat16().float() if bf16 else x  # BF16 logits: many ties, as a BF16 LM head gives


@pytest.mark.parametrize("bad, msg", [
    ({"temperature": 0}, "temperature must be in [0.01, 2], got 0"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"temperature": 0.005}, "vLLM raises a smaller one to 0.01 while the trainer divides by the value given"),
    ({"temperature": 2.5}, "temperature must be in [0.01, 2], got 2.5: vLLM refuses a larger one"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -2}, "top_k must be an integer >= -1 (-1 or 0: off), got -2"),
    ({"top_k": 2.5}, "top_k must be an integer >= -1"),
    ({"logprobs": "logits"}, "logprobs must be one of processed, raw, got 'logits'"),
])
def test_settings_outside_what_vllm_and_trl_define_are_refused_in_one_line(bad, msg):
    with pytest.raises(InputError, match=None) as err:
        SamplingSettings(**bad)
    assert msg in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-logits", "bf16-logits"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.label)
def test_the_kept_tokens_are_vllms_bit_for_bit(settings, bf16):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = _logits(bf16=bf16)
    scaled = logits / settings.temperature
    k = torch.full((logits.shape[0],), settings.top_k) if settings.top_k > 0 else None
    p = torch.full((logits.shape[0],), settings.top_p) if settings.top_p < 1 else None
    theirs = apply_top_k_top_p(scaled.clone(), k, p)  # what vLLM's CPU sampler calls
    assert torch.equal(kept_mask(logits, settings), torch.isfinite(theirs))
    # and the processed logprobs are the log-softmax of what vLLM samples from
    assert torch.equal(processed_logprobs(logits, settings), theirs.log_softmax(dim=-1, dtype=torch.float32))


def test_truncation_keeps_what_it_says():
    logits = _logits()
    assert kept_mask(logits, SamplingSettings()).all()
    assert (kept_mask(logits, SamplingSettings(top_k=5)).sum(-1) == 5).all()  # random logits: no ties
    assert (kept_mask(logits, SamplingSettings(top_p=1e-6)).sum(-1) == 1).all()  # only the largest
    kept = kept_mask(logits, SamplingSettings(top_p=0.9)).sum(-1)
    assert (kept >= 1).all() and (kept > 1).any() and (kept < logits.shape[-1]).all()


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.label)
def test_the_log_kept_mass_is_the_direct_sum_of_the_kept_probabilities(settings):
    logits = _logits(seed=1).double()
    mass = log_kept_mass(logits, settings)
    x = logits.numpy() / settings.temperature
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    direct = np.log((p * kept_mask(logits, settings).numpy()).sum(-1))
    np.testing.assert_allclose(mass.numpy(), direct, rtol=0, atol=1e-6)
    assert (mass <= 1e-6).all()  # a log probability, up to the FP32 floor
    if not settings.truncates:
        assert mass.abs().max() < 1e-6
    # processed = scaled - log S on every kept token
    kept = kept_mask(logits, settings)
    diff = recompute_logprobs(logits, settings.temperature) - processed_logprobs(logits, settings)
    np.testing.assert_allclose(diff[kept].numpy(), mass.unsqueeze(-1).expand_as(diff)[kept].numpy(), atol=1e-5)


@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("settings", SETTINGS[:4], ids=lambda s: s.label)
def test_the_split_adds_up_and_its_rounding_part_is_zero_with_identical_logits(settings, mode):
    logits = _logits(rows=8)
    trainer = logits + 0.01 * _logits(rows=8, seed=2)  # another stack's rounding of the same logits
    for row in range(8):
        y = int(torch.argmax(logits[row]))  # always kept
        smp = sampler_token(logits[row], y, settings)
        same = gap_split(float(recompute_logprobs(logits[row], settings.temperature)[y]), smp, mode)
        assert same["rounding"] == 0.0  # same logits, same transforms: nothing but rounding differs
        other = gap_split(float(recompute_logprobs(trainer[row], settings.temperature)[y]), smp, mode)
        for split in (same, other):
            parts = split["rounding"] + split["truncation"] + split["temperature"]
            assert split["total"] == pytest.approx(parts, abs=1e-12)
            if mode == "processed":
                assert split["temperature"] == 0.0
                assert split["truncation"] == pytest.approx(float(log_kept_mass(logits[row], settings)), abs=1e-5)
            else:
                assert split["truncation"] == 0.0
                t = settings.temperature
                assert split["temperature"] == pytest.approx(
                    float(recompute_logprobs(logits[row], t)[y] - raw_logprobs(logits[row])[y]), abs=1e-6)
        if settings.temperature == 1 and not settings.truncates:
            assert same["total"] == 0.0  # T = 1, no truncation: the reported logprob is the recompute's


# ------------------------------------------------------------ the trainer's side, in training


@pytest.mark.parametrize("settings", [s for s in SETTINGS if s.truncates])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_renormalised_logprob_and_the_kept_mass_are_the_samplers_own_functions_bit_for_bit(settings, bf16):
    """Where the sampled token is inside vLLM's kept set, ``trainer_logprobs: renormalised`` gives exactly the
    processed logprob and the split's truncation part exactly the log kept mass (torch.equal); a token outside it
    is flagged, kept in the support, and gets a finite logprob."""
    from rpa.core.sampling import kept_support, renormalised_logprobs, transform_part

    logits = _logits(bf16=bf16, seed=3)
    g = torch.Generator().manual_seed(4)
    targets = torch.multinomial(torch.softmax(logits / settings.temperature, -1), 1, generator=g)[:, 0]
    targets[:4] = logits.argmin(-1)[:4]  # four tokens no truncation keeps (except top_p = 1e-6's argmax rows)
    keep, outside = kept_support(logits, targets, settings)
    inside = kept_mask(logits, settings).gather(-1, targets[:, None])[:, 0]
    assert torch.equal(outside, ~inside) and outside[:4].all() and not outside[4:].all()
    renormalised = renormalised_logprobs(logits, targets, settings, keep)
    processed = processed_logprobs(logits, settings).gather(-1, targets[:, None])[:, 0]
    assert torch.equal(renormalised[inside], processed[inside])
    assert torch.isfinite(renormalised).all() and torch.isinf(processed[~inside]).all()
    part = transform_part(logits, targets, settings, keep)
    assert torch.equal(part[inside], log_kept_mass(logits, settings)[inside])
    assert (part <= 0).all()
    recompute = recompute_logprobs(logits, settings.temperature).gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(recompute - part, renormalised, atol=1e-5)  # the identity the split rests on


def test_the_temperature_part_is_the_recompute_less_the_raw_logprob_and_vanishes_at_t1():
    from rpa.core.sampling import transform_part

    logits, targets = _logits(seed=5), torch.arange(64) % 512
    raw = SamplingSettings(temperature=0.7, logprobs="raw")
    part = transform_part(logits, targets, raw, None)
    want = (recompute_logprobs(logits, 0.7) - raw_logprobs(logits)).gather(-1, targets[:, None])[:, 0]
    assert torch.equal(part, want) and part.abs().max() > 0.1
    assert torch.equal(transform_part(logits, targets, SamplingSettings(logprobs="raw"), None), torch.zeros(64))
    assert torch.equal(transform_part(logits, targets, SamplingSettings(), None), torch.zeros(64))


def test_the_per_step_split_is_the_total_less_the_measured_part():
    from rpa.measure.metrics import gap_split_metrics

    recompute = np.array([-1.0, -2.0, -0.5, -3.0])
    sampler = np.array([-0.9, -1.7, -0.5, -2.5])  # processed: renormalised, so above the recompute
    part = np.array([-0.1, -0.25, 0.0, -0.5])  # the log kept mass
    m = gap_split_metrics(recompute, sampler, part, [0, 1, 0, 0], "processed")
    assert m["total/mean_abs_dlogp"] == pytest.approx(0.9 / 4) and m["total/mean_dlogp"] == pytest.approx(-0.9 / 4)
    assert m["truncation/mean_dlogp"] == pytest.approx(-0.85 / 4)
    assert m["rounding/mean_abs_dlogp"] == pytest.approx(0.05 / 4) and m["rounding/mean_dlogp"] == pytest.approx(-0.05 / 4)
    assert m["outside_kept"] == 1 and not any(k.startswith("temperature") for k in m)
    raw = gap_split_metrics(recompute, sampler, part, [0, 0, 0, 0], "raw")
    assert set(raw) == {f"{p}/{s}" for p in ("total", "rounding", "temperature") for s in ("mean_abs_dlogp", "mean_dlogp")} | {"outside_kept"}
    with pytest.raises(ValueError, match="equally long"):
        gap_split_metrics(recompute, sampler, part[:3], [0, 0, 0], "processed")


LARGE = [SamplingSettings(top_p=0.9, top_k=50), SamplingSettings(temperature=0.7, top_p=0.9, top_k=200),
         SamplingSettings(top_p=0.95, top_k=1000), SamplingSettings(temperature=1.3, top_p=0.8)]


@pytest.mark.parametrize("settings", LARGE, ids=lambda s: s.label)
def test_the_kept_tokens_are_vllms_on_large_bf16_vocabularies_with_ties(settings):
    """Issue 72: on BF16 logits over a real model's vocabulary, tokens tied at the truncation's edge are many, and a
    rule that sorts the top-k-masked array (not the logits, as vLLM's CPU path does) or takes the top-p threshold
    1 - p in double (vLLM: float32) keeps other tokens there (366 of 4,608 rows differed). vLLM's own function is
    the reference, row for row."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = _logits(rows=1536, vocab=8192, seed=3, scale=3.0, bf16=True)
    scaled = logits / settings.temperature
    k = torch.full((logits.shape[0],), settings.top_k) if settings.top_k > 0 else None
    p = torch.full((logits.shape[0],), settings.top_p) if settings.top_p < 1 else None
    theirs = torch.isfinite(apply_top_k_top_p_pytorch(scaled.clone(), k, p))
    ours = kept_mask(logits, settings)
    assert torch.equal(ours, theirs), f"{int((ours != theirs).any(-1).sum())} of {logits.shape[0]} rows differ"


@pytest.mark.parametrize("settings", [SamplingSettings(temperature=0.7, top_p=0.9), SamplingSettings(top_k=20),
                                      SamplingSettings(temperature=0.6, top_p=0.8, top_k=20),
                                      SamplingSettings(temperature=0.7, logprobs="raw"),
                                      SamplingSettings(temperature=1.3, top_p=0.95, logprobs="raw")],
                         ids=lambda s: s.label)
def test_the_split_agrees_with_an_independent_float64_reckoning(settings):
    """Issue 74: the split's tests restated its definition (it adds up by construction; the temperature part's
    expected value was the implementation's own expression). Here every part is reckoned again from first principles
    in float64 numpy -- log-sum-exp by hand, the kept set as the smallest most-likely prefix holding ``top_p`` of the
    probability among the ``top_k`` largest -- on random FP32 logits (no ties), and the implementation must agree to
    FP32 precision, part by part."""
    import numpy as np

    def lse(x):
        m = x.max()
        return m + np.log(np.exp(x - m).sum())

    logits = _logits(rows=32, vocab=512, seed=11, scale=3.0)
    trainer = logits + 0.01 * _logits(rows=32, vocab=512, seed=12)
    t = settings.temperature
    for row in range(32):
        l, lt = logits[row].double().numpy(), trainer[row].double().numpy()
        y = int(np.argmax(l))  # always kept
        order = np.argsort(-l)  # descending, no ties
        kept = order[: settings.top_k] if settings.top_k > 0 else order
        probs = np.exp(l[kept] / t - lse(l[kept] / t)) if settings.top_k > 0 else np.exp(l[kept] / t - lse(l / t))
        if settings.top_p < 1:  # the smallest prefix holding top_p of the (top-k renormalised) probability
            kept = kept[: int(np.searchsorted(np.cumsum(probs), settings.top_p) + 1)]
        scaled = l[y] / t - lse(l / t)
        want = {"rounding": (lt[y] / t - lse(lt / t)) - scaled,
                "truncation": scaled - (l[y] / t - lse(l[kept] / t)) if settings.logprobs == "processed" else 0.0,
                "temperature": scaled - (l[y] - lse(l)) if settings.logprobs == "raw" else 0.0}
        got = gap_split(float(recompute_logprobs(trainer[row], t)[y]), sampler_token(logits[row], y, settings),
                        settings.logprobs)
        for part, value in want.items():
            assert got[part] == pytest.approx(value, abs=2e-5), (row, part, got, want)
        assert got["total"] == pytest.approx(sum(want.values()), abs=5e-5)
