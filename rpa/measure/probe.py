"""Offline mismatch probe: how far the sampler's policy μ (vLLM) is from the trainer's π.

For one model and one :class:`~rpa.core.numerics_config.NumericsConfig`:

1. **Tokens.** Either sample completions here with vLLM (temperature 1, sampled-token
   logprobs kept) or read a fixed set from ``--completions`` (what another probe run
   wrote). The pipeline samples once per model and scores every configuration on those
   identical tokens, so configurations are compared pairwise, token for token.
2. **μ.** vLLM scores prompt + completion with ``prompt_logprobs`` (decode-time logprobs
   equal prompt logprobs on the same tokens; a probe that samples checks that and
   reports the share that agree bitwise). Where the vocabulary is at most
   ``full_kl_max_vocab``, vLLM returns the whole distribution at every completion
   position and ``full_kl`` = KL(μ‖π) is computed per position; above that, vLLM would
   have to materialise ``vocab`` Python objects per token, so ``full_kl`` is ``null``
   with the reason in ``full_kl_note``.
3. **π, engine gap.** The trainer-side HF model, aligned and cast as the configuration
   says, recomputes every completion token one sequence at a time (batch 1, no padding:
   positions equal vLLM's). The DESIGN metrics over these are the top-level keys.
4. **π, trainer batch variance.** The same tokens in one padded batch laid out as TRL
   lays them out (prompts left-padded, completions right-padded, no ``position_ids``).
   ``trainer_batch_variance`` compares batch vs batch-1 (the trainer's own noise) and
   batch vs μ (the gap TRL would see).
5. **π, trainer decode variance** (``decode_sequences``). The first N sequences decoded by
   the trainer itself through its KV cache, teacher-forced (what ``rollouts: trainer``
   samples with): ``trainer_decode_variance`` compares that decode vs batch-1 (the
   residual of a trainer that samples its own rollouts) and vs μ.

Outputs in ``out_dir``: ``summary.json`` (schema :data:`SCHEMA`), ``tokens.csv`` (one row
per completion token, columns :data:`TOKEN_COLUMNS`) and, when sampling,
``completions.jsonl``. Trainer log-softmax is taken in FP32, as vLLM does.
"""

from __future__ import annotations

import csv
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rpa.core.errors import InputError
from rpa.core.fieldtypes import seed_problem
from rpa.core.jsonfiles import atomic_path, write_json
from rpa.measure.metrics import RATIO_BAND, full_kl, mismatch_metrics
from rpa.measure.prompts import DEFAULT_PROMPTS_DISTINCT, default_prompts, probe_prompts  # noqa: F401 - default_prompts: the diagnosis's too
from rpa.core.numerics_config import NumericsConfig
from rpa.core.runlog import log
from rpa.core.sampling import (REPORTED_PARTS, VLLM_LOGPROBS_MODE, LogprobsMode, SamplingSettings, gap_split,
                                sampling_field, settings_of)
from rpa.measure.scoring import (
    load_completions,
    sample_completions,
    sampler_logprobs,
    sampler_split_tokens,
    save_completions,
    trainer_batch_logprobs,
    trainer_decode_logprobs,
    trainer_recompute_logprobs,
    trainer_token_stats,
)

SCHEMA = "rpa.probe/1"
TOKEN_COLUMNS = ("seq", "position", "token_id", "logp_trainer", "logp_sampler", "p_sampler",
                 "logp_trainer_batch", "logp_decode", "full_kl", "entropy_trainer", "logp_trainer_decode")
"""``tokens.csv`` columns. ``position`` counts completion tokens from 0; ``p_sampler`` =
exp(``logp_sampler``); ``logp_decode`` (vLLM's logprob at sampling time), ``full_kl`` and
``logp_trainer_batch`` (past ``batch_sequences``) and ``logp_trainer_decode`` (the trainer's own
KV-cached decode, past ``decode_sequences``) are empty where not measured; ``entropy_trainer`` is
the entropy (nats) of the trainer's next-token distribution at that position (mismatch tracks it:
report them together)."""


@dataclass(frozen=True)
class ProbeOptions:
    """The probe's options: the ``rpa probe`` flags and the ``probe:`` section of a pipeline config
    are built from these fields (:func:`rpa.core.fieldtypes.add_arguments`, :func:`~rpa.core.fieldtypes.to_flags`)."""

    prompts: int = field(default=16, metadata={"help": "prompts to sample completions for"})
    samples: int = field(default=2, metadata={"help": "completions per prompt"})
    max_tokens: int = field(default=64, metadata={"help": "tokens per completion at most"})
    seed: int = field(default=0, metadata={"help": "seed of the prompts and of vLLM's sampling"})
    full_kl_max_vocab: int = field(default=4096, metadata={"help": "compute full_kl only for vocabularies up to this size"})
    ratio_band: tuple[float, float] = field(default=RATIO_BAND, metadata={
        "help": "the band of pi/mu ratios counted as inside (frac_ratio_outside)",
        "metavar": ("LO", "HI")})
    compiled: bool = field(default=False, metadata={"help": "run vLLM compiled (default: eager)"})
    max_model_len: int = field(default=1024, metadata={"help": "vLLM's context length"})
    batch_sequences: int | None = field(default=None, metadata={
        "help": "sequences in the trainer's padded batch (trainer_batch_variance): the first N (default: all); a "
                "smaller batch bounds the cost of that second trainer pass on a large model"})
    decode_sequences: int | None = field(default=None, metadata={
        "help": "the first N sequences also decoded by the trainer itself through its KV cache, teacher-forced "
                "(trainer_decode_variance: what a trainer sampling its own rollouts scores vs its recompute); "
                "default: not measured"})
    temperature: float = sampling_field("temperature")
    top_p: float = sampling_field("top_p")
    top_k: int = sampling_field("top_k")
    logprobs: LogprobsMode = sampling_field("logprobs")
    split_sequences: int | None = field(default=None, metadata={
        "help": "the first N sequences' gap between the trainer's recompute (at the temperature, whole vocabulary) and "
                "the logprob the sampler reports, split into rounding, truncation and temperature (sampling_split; "
                "needs the sampler's whole distribution at each position); default: not measured"})
    prompts_file: str | None = field(default=None, metadata={
        "help": "sample from the first --prompts prompts of this file (JSON lines with 'prompt', a string or a chat "
                "conversation rendered with the model's chat template; or one prompt per line; `rpa prompts` writes "
                "one from a task) instead of the built-in ones"})

    def __post_init__(self) -> None:
        for name in ("prompts", "samples", "max_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise InputError(f"probe option {name} must be >= 1, got {getattr(self, name)}")
        if self.prompts_file is None and self.prompts > DEFAULT_PROMPTS_DISTINCT:
            raise InputError(f"probe option prompts {self.prompts}: the built-in prompts are "
                             f"{DEFAULT_PROMPTS_DISTINCT} distinct ones, more would repeat them (more completions: "
                             f"--samples; more prompts: --prompts-file)")
        if self.max_tokens >= self.max_model_len:
            raise InputError(f"probe option max_tokens {self.max_tokens} leaves no room for a prompt in "
                             f"max_model_len {self.max_model_len}")
        if seed_problem(self.seed):
            raise InputError(f"probe option seed {seed_problem(self.seed)}")
        if self.full_kl_max_vocab < 0:
            raise InputError(f"probe option full_kl_max_vocab must be >= 0 (0: never), got {self.full_kl_max_vocab}")
        if self.decode_sequences is not None and (isinstance(self.decode_sequences, bool) or self.decode_sequences < 1):
            raise InputError(f"probe option decode_sequences must be >= 1, got {self.decode_sequences}")
        if self.batch_sequences is not None and (isinstance(self.batch_sequences, bool) or self.batch_sequences < 2):
            raise InputError(f"probe option batch_sequences must be >= 2 (a padded batch), got {self.batch_sequences}")
        if self.split_sequences is not None and (isinstance(self.split_sequences, bool) or self.split_sequences < 1):
            raise InputError(f"probe option split_sequences must be >= 1, got {self.split_sequences}")
        problem = SamplingSettings.problem(self)  # the sampling fields, checked as SamplingSettings checks them
        if problem:
            raise InputError(f"probe option {problem}")
        lo, hi = self.ratio_band
        if not 0 < lo < 1 < hi:
            raise InputError(f"ratio_band must satisfy 0 < lo < 1 < hi, got {tuple(self.ratio_band)}")

    @property
    def sampling(self) -> SamplingSettings:
        """How the probe's sampler draws and what it reports (:class:`~rpa.core.sampling.SamplingSettings`)."""
        return settings_of(self)

    def check_engine_bounds(self) -> None:
        """The bounds vLLM itself sets on these options, read from vLLM (apart from ``__post_init__``:
        importing vLLM takes seconds): ``samples`` at most its ``n`` per request
        (:func:`rpa.sides.engine.max_n_sequences`). Checked before a probe that samples starts its engine."""
        from rpa.sides.engine import max_n_sequences

        if self.samples > max_n_sequences():
            raise InputError(f"probe option samples {self.samples}: vLLM samples at most {max_n_sequences()} "
                             f"completions per prompt (its VLLM_MAX_N_SEQUENCES)")


def _log(msg: str) -> None:
    log("probe", msg)


def _pair_stats(a: list[float], b: list[float]) -> dict[str, float]:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    d = np.abs(x - y)
    return {"mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()),
            "frac_bitwise_equal": float(np.mean(np.asarray(a) == np.asarray(b)))}


SPLIT_PARTS = ("total", "rounding", "truncation", "temperature")
"""The parts of ``sampling_split`` (:func:`rpa.core.sampling.gap_split`): ``total`` = the sum of the others."""

SPLIT_COLUMNS = ("seq", "position", "token_id", "logp_recompute", "logp_sampler_raw", "logp_sampler_scaled",
                 "logp_sampler_processed", *SPLIT_PARTS)
"""``split.csv``: per completion token of the first ``split_sequences`` sequences, the trainer's recompute at the
temperature, the sampler's raw, temperature-scaled and processed logprob, and the gap's parts."""


def split_rows(split, trn, smp, sampling: SamplingSettings) -> list[dict[str, Any]]:
    """The rows of ``split.csv`` (:data:`SPLIT_COLUMNS`): each token's logprobs and the gap's parts."""
    return [{"seq": c["seq"], "position": j, "token_id": tok, "logp_recompute": r, "logp_sampler_raw": t.raw,
             "logp_sampler_scaled": t.scaled, "logp_sampler_processed": t.processed,
             **gap_split(r, t, sampling.logprobs)}
            for c, recompute, tokens in zip(split, trn, smp)
            for j, (tok, r, t) in enumerate(zip(c["completion_ids"], recompute, tokens))]


def sampling_split(rows: list[dict[str, Any]], sequences: int, sampling: SamplingSettings,
                   ratio_band) -> dict[str, Any]:
    """The gap between the trainer's recompute and what the sampler reports on the identical tokens (``rows``:
    :func:`split_rows` of ``sequences`` sequences), and each part of it the mode reports
    (:data:`~rpa.core.sampling.REPORTED_PARTS`), with the probe's metrics
    (:func:`~rpa.measure.metrics.mismatch_metrics` of a pair whose difference is the part). A token outside the
    sampler's own kept set (possible on tokens another configuration sampled: rounding moved the truncation's
    edge) has no processed logprob: counted in ``outside_kept`` and left out of every part."""
    kept = [r for r in rows if math.isfinite(r["logp_sampler_processed"])]
    reported = "logp_sampler_processed" if sampling.logprobs == "processed" else "logp_sampler_raw"
    pairs = {"total": ("logp_recompute", reported), "rounding": ("logp_recompute", "logp_sampler_scaled"),
             "truncation": ("logp_sampler_scaled", "logp_sampler_processed"),
             "temperature": ("logp_sampler_scaled", "logp_sampler_raw")}
    seqs = [r["seq"] for r in kept]
    parts = {part: mismatch_metrics([r[pairs[part][0]] for r in kept], [r[pairs[part][1]] for r in kept], seqs,
                                    ratio_band) for part in REPORTED_PARTS[sampling.logprobs]}
    return {"settings": asdict(sampling), "label": sampling.label, "sequences": sequences, "tokens": len(rows),
            "outside_kept": len(rows) - len(kept), "parts": parts}


def write_split_tokens(path: Path, rows: list[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(SPLIT_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------------ driver


def recorded_options(model: str, numerics: NumericsConfig, options: ProbeOptions,
                     completions_path: str | Path | None) -> dict[str, Any]:
    """What a probe's output directory records (``options.json``): a rerun with others is refused
    (a prompts file by its content as well as its path)."""
    import hashlib

    digest = None if options.prompts_file is None or not Path(options.prompts_file).is_file() else \
        hashlib.sha1(Path(options.prompts_file).read_bytes()).hexdigest()[:12]
    return {"model": str(model), "numerics": numerics.to_dict(), **asdict(options), "prompts_file_sha1": digest,
            "completions": None if completions_path is None else str(completions_path)}


def run_probe(model: str, numerics: NumericsConfig, out_dir: str | Path, options: ProbeOptions = ProbeOptions(),
              completions_path: str | Path | None = None, replace: bool = False) -> dict[str, Any]:
    """Run the probe; writes ``options.json``, ``summary.json``, ``tokens.csv`` (and ``completions.jsonl``);
    ``replace``: :func:`rpa.core.outdir.claim`. The phases: the sampler's side (:func:`_sampler_side`: vLLM
    samples or takes the completions and scores them), the trainer's (:func:`_trainer_side`: the same tokens
    one sequence at a time, in a padded batch, by KV-cached decoding and for the sampling split), the per-token
    table (:func:`_token_rows`) and the summary (:func:`_probe_summary`)."""
    from transformers import AutoConfig

    from rpa.core.outdir import claim
    from rpa.core.provenance import provenance

    out, done = claim(out_dir, "probe", recorded_options(model, numerics, options, completions_path),
                      replace=replace)
    if done is not None:
        _log(f"{out}: finished with these options already; nothing to do (delete it to run again)")
        return done
    t0 = time.time()
    started = provenance(model)  # the code that ran is the code at the start
    vocab = int(AutoConfig.from_pretrained(model).vocab_size)
    full = vocab <= options.full_kl_max_vocab
    sampler = _sampler_side(model, numerics, options, completions_path, out, vocab, full)
    trainer = _trainer_side(model, numerics, options, sampler, full)
    rows = _token_rows(sampler, trainer, full)
    summary = _probe_summary(rows, sampler, trainer, options, full, vocab, out)
    if completions_path is None:
        summary["decode_vs_prompt_logprobs"] = _pair_stats([r["logp_decode"] for r in rows],
                                                           [r["logp_sampler"] for r in rows])
    summary["config"] = {"model": str(model), "numerics": numerics.to_dict(), "options": asdict(options),
                         "mode": "compiled" if options.compiled else "eager",
                         "completions": str(completions_path) if completions_path else "sampled",
                         "trainer": trainer["record"], "vocab_size": vocab}
    summary["provenance"] = started
    summary["wall_s"] = round(time.time() - t0, 2)
    with atomic_path(out / "tokens.csv") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(TOKEN_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    write_json(out / "summary.json", summary)  # atomic, and last: a probe with a summary is whole
    _log(f"done in {summary['wall_s']} s -> {out}")
    return summary


def _sampler_side(model: str, numerics: NumericsConfig, options: ProbeOptions, completions_path, out: Path,
                  vocab: int, full: bool) -> dict[str, Any]:
    """vLLM's side: the completions (sampled and saved, or read), their sampler logprobs (and full distributions
    where the vocabulary is small enough), the sampling split's sampler tokens; the engine closed after."""
    from transformers import AutoTokenizer

    from rpa.sides.engine import close_llm, make_llm, release_memory

    _log(f"{model}: {numerics.to_dict()}; starting vLLM ({'compiled' if options.compiled else 'eager'})")
    sampling = options.sampling
    llm = make_llm(model, numerics, enforce_eager=not options.compiled, seed=options.seed,
                   max_model_len=options.max_model_len, enable_prefix_caching=False,
                   max_logprobs=vocab if full or options.split_sequences else 20,
                   logprobs_mode=VLLM_LOGPROBS_MODE[sampling.logprobs])
    if completions_path is None:
        tokenizer = AutoTokenizer.from_pretrained(model)  # to render a chat-format prompt file's conversations
        prompts = probe_prompts(options.prompts, options.seed, options.prompts_file, tokenizer)
        completions = sample_completions(llm, prompts, options.samples, options.max_tokens, sampling)
        save_completions(out / "completions.jsonl", completions)
        _log(f"sampled {len(completions)} completions")
    else:
        completions = load_completions(completions_path)
        _log(f"scoring {len(completions)} fixed completions from {completions_path}")
    mu, mu_dist = sampler_logprobs(llm, completions, vocab if full else None)
    split = completions[: options.split_sequences or 0]
    smp_split = sampler_split_tokens(llm, split, vocab, sampling) if split else []
    close_llm(llm)  # its memory back before the trainer model loads (vLLM holds most of a GPU)
    del llm
    release_memory()
    _log("vLLM scoring done and engine closed; trainer side")
    return {"completions": completions, "mu": mu, "mu_dist": mu_dist, "split": split, "smp_split": smp_split}


def _trainer_side(model: str, numerics: NumericsConfig, options: ProbeOptions, sampler: dict[str, Any],
                  full: bool) -> dict[str, Any]:
    """The trainer's side on the sampler's very tokens: one sequence at a time (logprob, entropy, and the full
    KL where the vocabulary allows), the padded batch as TRL lays it out, the split's recompute at the sampling
    temperature, KV-cached decoding; the alignment's record taken before its patch comes off."""
    from transformers import AutoTokenizer

    from rpa.sides.trainer import load_trainer_model, trainer_context

    completions, split = sampler["completions"], sampler["split"]
    hf, alignment = load_trainer_model(numerics, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pi, pi_kl, pi_entropy = [], [], []
    with trainer_context(numerics):
        for c, dist in zip(completions, sampler["mu_dist"] or [None] * len(completions)):
            picked, entropy, pi_dist = trainer_token_stats(hf, c["prompt_ids"], c["completion_ids"], full=full)
            if full:
                pi_kl.append(full_kl(dist, pi_dist))
            pi.append(picked)
            pi_entropy.append(entropy)
        batch = completions[: options.batch_sequences]  # None: every sequence
        pi_batch = trainer_batch_logprobs(hf, batch, pad_id) + [[math.nan] * len(c["completion_ids"])
                                                                 for c in completions[len(batch):]]
        trn_split = [trainer_recompute_logprobs(hf, c["prompt_ids"], c["completion_ids"],
                                                options.sampling.temperature) for c in split]
        decoded = completions[: options.decode_sequences or 0]
        pi_decode = [trainer_decode_logprobs(hf, c["prompt_ids"], c["completion_ids"]) for c in decoded] + \
            [[math.nan] * len(c["completion_ids"]) for c in completions[len(decoded):]]
    record = alignment.describe()  # the trainer that scored the tokens, before the patch comes off
    alignment.remove()
    return {"pi": pi, "pi_kl": pi_kl, "pi_entropy": pi_entropy, "batch": batch, "pi_batch": pi_batch,
            "trn_split": trn_split, "decoded": decoded, "pi_decode": pi_decode, "record": record}


def _token_rows(sampler: dict[str, Any], trainer: dict[str, Any], full: bool) -> list[dict[str, Any]]:
    """One row per completion token (``tokens.csv``'s columns)."""
    rows = []
    mu, pi, pi_batch, pi_decode = sampler["mu"], trainer["pi"], trainer["pi_batch"], trainer["pi_decode"]
    for i, c in enumerate(sampler["completions"]):
        decode = c.get("logp_decode")
        for j, tok in enumerate(c["completion_ids"]):
            rows.append({"seq": c["seq"], "position": j, "token_id": tok, "logp_trainer": pi[i][j],
                         "logp_sampler": mu[i][j], "p_sampler": math.exp(mu[i][j]),
                         "logp_trainer_batch": "" if math.isnan(pi_batch[i][j]) else pi_batch[i][j],
                         "logp_decode": "" if decode is None else decode[j],
                         "full_kl": float(trainer["pi_kl"][i][j]) if full else "",
                         "entropy_trainer": trainer["pi_entropy"][i][j],
                         "logp_trainer_decode": "" if math.isnan(pi_decode[i][j]) else pi_decode[i][j]})
    return rows


def _probe_summary(rows: list[dict[str, Any]], sampler: dict[str, Any], trainer: dict[str, Any],
                   options: ProbeOptions, full: bool, vocab: int, out: Path) -> dict[str, Any]:
    """The summary's measurements: the mismatch metrics, the entropy, the full KL (or why not), the trainer's own
    batch and decode variance, the sampling split (and ``split.csv``)."""
    col = lambda name: [r[name] for r in rows]  # noqa: E731
    metrics = mismatch_metrics(col("logp_trainer"), col("logp_sampler"), col("seq"), options.ratio_band)
    summary: dict[str, Any] = {"schema": SCHEMA, **metrics, "entropy": float(np.mean(col("entropy_trainer")))}
    if full:
        kl = np.concatenate(trainer["pi_kl"])
        summary.update(full_kl=float(kl.mean()), full_kl_max=float(kl.max()),
                       full_kl_note=f"exact KL(mu||pi) over all {vocab} vocabulary entries, mean over positions")
    else:
        summary.update(full_kl=None, full_kl_max=None,
                       full_kl_note=f"vocabulary {vocab} > full_kl_max_vocab {options.full_kl_max_vocab}: not computed")
    in_batch = [r for r in rows if r["logp_trainer_batch"] != ""]  # the sequences of the padded batch
    batched = lambda name: [r[name] for r in in_batch]  # noqa: E731
    summary["trainer_batch_variance"] = {
        "batch_size": len(trainer["batch"]),
        "batch_vs_single": _pair_stats(batched("logp_trainer_batch"), batched("logp_trainer")),
        "batch_vs_sampler": _pair_stats(batched("logp_trainer_batch"), batched("logp_sampler")),
    }
    if trainer["decoded"]:
        in_decode = [r for r in rows if r["logp_trainer_decode"] != ""]
        of = lambda name: [r[name] for r in in_decode]  # noqa: E731
        summary["trainer_decode_variance"] = {
            "sequences": len(trainer["decoded"]), "tokens": len(in_decode),
            "decode_vs_single": _pair_stats(of("logp_trainer_decode"), of("logp_trainer")),
            "decode_vs_sampler": _pair_stats(of("logp_trainer_decode"), of("logp_sampler")),
        }
    split = sampler["split"]
    if split:
        split_table = split_rows(split, trainer["trn_split"], sampler["smp_split"], options.sampling)
        summary["sampling_split"] = sampling_split(split_table, len(split), options.sampling, options.ratio_band)
        write_split_tokens(out / "split.csv", split_table)  # made once: the summary and split.csv
    return summary
