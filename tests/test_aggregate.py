"""The probe table of the default pipeline (analysis/aggregate.py) and the paired statistics it
shares with the study (analysis/paired.py), on synthetic probe results (no engines)."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis import aggregate
from analysis.paired import paired_change, positions_only, t975, t_change

STOCK = {"regions": "none", "precision": "bf16", "lm_head_fp32": False, "trainer_mode": "compute",
         "trainer_positions": "mask"}
METRIC_VALUES = {m: 0.0 for m in aggregate.METRICS}


def tokens(abs_per_seq: np.ndarray, per_seq: int = 20) -> pd.DataFrame:
    """A tokens.csv frame whose sequence ``i`` has |dlogp| = ``abs_per_seq[i]`` on every token."""
    rows = []
    for seq, a in enumerate(abs_per_seq):
        for pos in range(per_seq):
            sampler = -2.0 - 0.01 * pos
            sign = 1 if pos % 2 else -1
            rows.append({"seq": seq, "position": pos, "token_id": 3 + pos, "logp_trainer": sampler + sign * a,
                         "logp_sampler": sampler, "logp_trainer_batch": sampler + sign * a})
    return pd.DataFrame(rows)


def write_probe(results, model: str, config: str, numerics: dict, abs_per_seq: np.ndarray | None,
                with_tokens: bool = True) -> None:
    d = results / "probe" / model / config
    d.mkdir(parents=True, exist_ok=True)
    frame = tokens(abs_per_seq if abs_per_seq is not None else np.full(8, 0.01))
    if with_tokens:
        frame.to_csv(d / "tokens.csv", index=False)
    d_logp = frame.logp_trainer - frame.logp_sampler
    summary = {"config": {"numerics": {**STOCK, **numerics}}, **METRIC_VALUES, "tokens": len(frame),
               "mean_abs_dlogp": float(d_logp.abs().mean()),
               "trainer_batch_variance": {"batch_vs_single": {"mean_abs_dlogp": 0.0},
                                          "batch_vs_sampler": {"mean_abs_dlogp": 0.0}}}
    (d / "summary.json").write_text(json.dumps(summary))


def _grid(results, model: str, rope: np.ndarray, base: np.ndarray, rng, with_tokens: bool = True) -> None:
    write_probe(results, model, "none", {}, base, with_tokens)
    write_probe(results, model, "positions-stock", {"trainer_positions": "stock"}, base, with_tokens)
    write_probe(results, model, "rope", {"regions": "rope"}, rope, with_tokens)
    for region in ("swiglu", "rmsnorm"):  # noise around the baseline: no distinguishable change
        write_probe(results, model, region, {"regions": region}, base * rng.uniform(0.6, 1.4, base.size), with_tokens)


def test_region_named_only_where_its_interval_excludes_zero(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.uniform(0.005, 0.02, 40)
    _grid(tmp_path, "m-clear", base * 0.7, base, rng)  # rope: -30% on every sequence
    _grid(tmp_path, "m-noise", base * rng.uniform(0.5, 1.5, base.size), base, rng)  # rope: noise only
    df = aggregate.probe_table(tmp_path, ["none", "positions-stock", "rope", "swiglu", "rmsnorm"])
    by = df.set_index(["model", "config"])
    clear = by.loc[("m-clear", "rope")]
    assert clear.mean_abs_dlogp_change == pytest.approx(-0.3) and clear.mean_abs_dlogp_high < 0
    noise = by.loc[("m-noise", "rope")]
    assert noise.mean_abs_dlogp_low < 0 < noise.mean_abs_dlogp_high
    assert by.loc[("m-clear", "none"), "change_note"] == "reference"
    assert math.isnan(by.loc[("m-clear", "positions-stock"), "mean_abs_dlogp_change"])
    assert by.loc[("m-clear", "positions-stock"), "change_note"] == "n/a (unpadded probe)"
    text = aggregate.markdown(df)
    clear_part, noise_part = text.split("### m-noise")[0], text.split("### m-noise")[1]
    assert "interval below zero: **rope** (-30.0% [" in clear_part
    assert "**" not in noise_part.split("|")[-1] and "distinguishable from zero" in noise_part
    assert "n/a (unpadded probe)" in clear_part


def test_probe_table_without_tokens_names_the_lowest_but_says_there_is_no_interval(tmp_path):
    rng = np.random.default_rng(4)
    base = rng.uniform(0.005, 0.02, 12)
    _grid(tmp_path, "m", base * 0.7, base, rng, with_tokens=False)
    df = aggregate.probe_table(tmp_path)
    assert df.mean_abs_dlogp_change.isna().all()
    text = aggregate.markdown(df)
    assert "**rope**" in text and "no interval (tokens.csv missing)" in text and "no tokens.csv" in text


def test_paired_change_is_paired_over_sequences():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.001, 0.1, 30)  # sequences differ 100-fold; the pairing removes that
    c = paired_change(tokens(base * 0.9), tokens(base))["mean_abs_dlogp"]
    assert c["change"] == pytest.approx(-0.1) and c["low"] == pytest.approx(-0.1) and c["high"] == pytest.approx(-0.1)


def test_t_change_uses_student_t_over_pairs():
    assert t975(2) == 4.303 and abs(t975(200) - 1.972) < 1e-3
    logs = [0.1, 0.2, 0.3]
    c = t_change(logs)
    half = 4.303 * 0.1 / math.sqrt(3)
    assert c["change"] == pytest.approx(math.expm1(0.2))
    assert c["low"] == pytest.approx(math.expm1(0.2 - half)) and c["high"] == pytest.approx(math.expm1(0.2 + half))
    one = t_change([0.2])
    assert one["change"] == pytest.approx(math.expm1(0.2)) and math.isnan(one["low"])


def test_an_fp32_trainer_row_is_never_the_stock_bf16_base(tmp_path):
    """Without a row named ``none`` the base of "vs none" is the stock BF16 row: a ``trainer_precision: fp32``
    row has every other stock value (regions none, precision bf16, ...) but is not it, even sorted first."""
    write_probe(tmp_path, "m", "a-trainer-fp32", {"trainer_precision": "fp32"}, np.full(8, 0.03))
    write_probe(tmp_path, "m", "b-stock", {}, np.full(8, 0.01))
    df = aggregate.probe_table(tmp_path)
    assert list(df.columns) == list(aggregate.PROBE_COLUMNS)  # the table's columns as they were
    by = df.set_index("config")
    assert by.loc["b-stock", "change_note"] == "reference" and by.loc["b-stock", "rel_mean_abs_dlogp_vs_none"] == 1
    assert by.loc["a-trainer-fp32", "rel_mean_abs_dlogp_vs_none"] == pytest.approx(3)


def test_positions_only():
    assert positions_only(STOCK, {**STOCK, "trainer_positions": "stock"})
    assert not positions_only(STOCK, {**STOCK, "trainer_positions": "stock", "regions": "rope"})
    assert not positions_only(STOCK, dict(STOCK)) and not positions_only(None, STOCK)


def write_sampling_cell(results, setting: str, config: str, rounding: np.ndarray, truncation: np.ndarray,
                        sampler: bool, outside: int = 0) -> None:
    """A probe cell at a sampling setting (processed logprobs): sequence ``i``'s tokens have the given |rounding|
    and log kept mass; ``outside`` extra tokens of sequence 0 lie outside the sampler's kept set."""
    from rpa.core.sampling import SamplingSettings, SamplerToken, gap_split

    d = results / "probe-sampling" / "m" / setting / config
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq, (r, t) in enumerate(zip(rounding, truncation)):
        for pos in range(10):
            scaled = -1.0 - 0.1 * pos
            sign = 1 if pos % 2 else -1
            token = SamplerToken(raw=scaled - 0.2, scaled=scaled, processed=scaled - t)
            rows.append({"seq": seq, "position": pos, "token_id": 5, "logp_recompute": scaled + sign * r,
                         "logp_sampler_raw": token.raw, "logp_sampler_scaled": token.scaled,
                         "logp_sampler_processed": token.processed,
                         **gap_split(scaled + sign * r, token, "processed")})
    rows += [{**rows[0], "position": 10 + i, "logp_sampler_processed": -math.inf} for i in range(outside)]
    pd.DataFrame(rows).to_csv(d / "split.csv", index=False)
    settings = SamplingSettings(top_p=0.9)
    summary = {"config": {"completions": "sampled" if sampler else "x/completions.jsonl"},  # as rpa probe records it
               "sampling_split": {"settings": {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "logprobs": "processed"},
                                  "label": settings.label, "sequences": len(rounding), "tokens": len(rows),
                                  "outside_kept": outside}}
    (d / "summary.json").write_text(json.dumps(summary))


def test_the_sampling_table_splits_the_gap_with_intervals_and_pairs_the_rounding_change(tmp_path):
    """analysis.probe_sampling: each part is the token mean of |part| over the split's sequences (tokens outside the
    kept set left out) with a bootstrap interval over sequences that holds it; the rounding part's change vs the
    sampler's configuration is paired on the same tokens; the sentence names the larger source."""
    from analysis import probe_sampling

    rng = np.random.default_rng(0)
    base = rng.uniform(0.02, 0.04, 8)
    truncation = rng.uniform(-0.08, -0.04, 8)  # log kept mass <= 0: larger than rounding here
    write_sampling_cell(tmp_path, "T1-p0.9", "none", base, truncation, sampler=True, outside=3)
    write_sampling_cell(tmp_path, "T1-p0.9", "all", base * 0.5, truncation, sampler=False, outside=3)
    df = probe_sampling.sampling_table(tmp_path)
    assert list(df.config) == ["none", "all"] and list(df.sampler) == [True, False]
    none, all_ = df.iloc[0], df.iloc[1]
    assert none.rounding_mean_abs_dlogp == pytest.approx(base.mean())
    assert none.truncation_mean_abs_dlogp == pytest.approx(-truncation.mean())
    assert none.rounding_mean_abs_dlogp_low < none.rounding_mean_abs_dlogp < none.rounding_mean_abs_dlogp_high
    assert math.isnan(none.temperature_mean_abs_dlogp) and none.temperature == 1.0
    assert none.outside_kept == 3 and none.tokens == 83
    assert all_.rounding_change == pytest.approx(-0.5) and all_.rounding_change_low == pytest.approx(-0.5)
    assert math.isnan(none.rounding_change)
    md = probe_sampling.markdown(df)
    assert "T1-p0.9: truncation the larger" in md and "rounding vs sampler's config" in md
    write_sampling_cell(tmp_path, "T1-p0.9", "none", base, truncation * 0.1, sampler=True)
    assert "T1-p0.9: rounding the larger" in probe_sampling.markdown(probe_sampling.sampling_table(tmp_path))
