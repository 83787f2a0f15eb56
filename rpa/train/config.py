"""The configuration of one GRPO run (``rpa train --config FILE.yaml``), as validated data.

Every knob has a default here and is written out in full to ``RUN_DIR/config.json``;
unknown keys and bad values raise :class:`TrainConfigError` naming the key, before any
model is loaded. The grouping follows TRL's ``GRPOConfig`` where the option is TRL's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from rpa.train.collapse import CollapseThresholds
from rpa.core.errors import UserError
from rpa.core.fieldtypes import FieldTypeError, check_choices, choices, seed_problem, typed
from rpa.core.numerics_config import NumericsConfig, NumericsConfigError
from rpa.core.sampling import LogprobsMode, TrainerLogprobs, sampling_field, settings_of
from rpa.train.tasks import SYNTHETIC, TaskError, TaskSpec

# The enumerated options: each a ``Literal`` type, checked once where values are coerced
# (rpa.core.fieldtypes) and in __post_init__ by the same function; the tuples are their values.
IsCorrection = Literal["off", "token_truncate", "sequence_mask"]
OldLogprobs = Literal["trainer", "sampler"]
Rollouts = Literal["vllm", "trainer"]
"""Who samples the rollouts: ``vllm`` (the colocated engine: the mismatch under study) or ``trainer``
(the trainer's own BF16 compute path: the mismatch-free control, mu = pi up to decode vs recompute)."""
TrainerDecode = Literal["cached", "recompute"]
"""How ``rollouts: trainer`` samples: KV-cached decoding, or one forward of the whole prefix per token."""
AttnImplementation = Literal["sdpa", "eager"]
"""The trainer's attention kernel (transformers' ``attn_implementation``)."""
TrainerBatching = Literal["padded", "per_row"]
"""How the trainer lays out the sequences it scores (and, with ``rollouts: trainer``, samples): TRL's
padded batches, or each sequence alone without its padding."""
LrSchedule = Literal["linear", "constant", "cosine"]
"""``lr_scheduler_type`` values (transformers' names): ``linear`` decays to 0 (TRL's default)."""
ScaleRewards = Literal["group", "batch", "none"]
"""TRL ``scale_rewards``: what GRPO divides the centred rewards by (group std, batch std, nothing)."""

IS_CORRECTIONS: dict[str, str | None] = {c: None if c == "off" else c for c in choices(IsCorrection)}
"""Importance-sampling correction -> TRL ``vllm_importance_sampling_mode`` (None: correction off)."""
OLD_LOGPROBS, ROLLOUTS = choices(OldLogprobs), choices(Rollouts)
LR_SCHEDULES, SCALE_REWARDS = choices(LrSchedule), choices(ScaleRewards)


class TrainConfigError(UserError):
    """An invalid run config (the message names the key)."""


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm start on the task's (prompt, answer) pairs before GRPO."""

    steps: int = field(default=0, metadata={"help": "supervised steps (0: none)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "learning rate of the warm start"})
    batch_size: int = field(default=16, metadata={"help": "(prompt, answer) pairs per warm-start step"})

    def __post_init__(self) -> None:
        if self.steps < 0 or not self.learning_rate > 0 or self.batch_size < 1:
            raise ValueError(f"steps must be >= 0, learning_rate > 0 and batch_size >= 1; got steps {self.steps}, "
                             f"learning_rate {self.learning_rate}, batch_size {self.batch_size}")


@dataclass(frozen=True)
class SyncCheck:
    """After every weight sync vLLM and the trainer score a fixed probe sequence
    (:mod:`rpa.train.sync_check`). The start-up check, on equal weights, measures this model's
    rounding gap; later checks are judged against it: over ``relative_tolerance`` times that gap
    with vLLM's logprobs unchanged means stale weights (the run stops), otherwise it is recorded
    (``sync/over_tolerance``). At the start, over ``start_tolerance`` means the engines did not
    load the same weights. Over ``abort_gap`` (or not finite) the engines have blown apart: the
    run stops as a collapse."""

    relative_tolerance: float = field(default=3.0, metadata={
        "help": "Over this many times the start-up (equal-weights) gap, a later check is over tolerance."})
    start_tolerance: float = field(default=1.0, metadata={
        "help": "Mean |dlogp| at start-up above which the engines hold different weights (rounding gives ~5e-3 on the"
                " tiny models, ~0.05 on SmolLM2-135M; other weights give whole nats)."})
    tolerance: float | None = field(default=None, metadata={
        "help": "An absolute floor under the relative threshold (None: relative only). Runs configured before the "
                "relative rule set 0.05 here."})
    abort_gap: float = field(default=5.0, metadata={
        "help": "mean |dlogp| of a sync check above which (or not finite) the engines have blown apart: the run stops"
                " as a collapse"})
    probe_tokens: int = field(default=32, metadata={
        "help": "Tokens of the fixed probe sequence (its first is the prompt: at least 2)."})

    def __post_init__(self) -> None:
        if not (self.relative_tolerance >= 1 and 0 < self.start_tolerance < self.abort_gap
                and (self.tolerance is None or 0 < self.tolerance < self.abort_gap)) or self.probe_tokens < 2:
            raise ValueError(f"relative_tolerance >= 1, 0 < start_tolerance < abort_gap, 0 < tolerance < abort_gap "
                             f"(or null) and probe_tokens >= 2 are required; got relative_tolerance "
                             f"{self.relative_tolerance}, start_tolerance {self.start_tolerance}, tolerance "
                             f"{self.tolerance}, abort_gap {self.abort_gap}, probe_tokens {self.probe_tokens}")


@dataclass(frozen=True)
class TrainConfig:
    model: str = field(metadata={"help": "checkpoint directory (or hub id) both sides load"})
    task: TaskSpec = field(default_factory=TaskSpec, metadata={
        "help": "the task: prompts, reward and held-out prompts (TaskSpec)"})
    numerics: NumericsConfig = field(default_factory=NumericsConfig, metadata={
        "help": "the numerics configuration of both sides (NumericsConfig: regions, precision, ...)"})
    is_correction: IsCorrection = field(default="off", metadata={
        "help": "importance-sampling correction of the trainer-sampler mismatch (TRL's "
                "vllm_importance_sampling_mode): off, token_truncate or sequence_mask (IS_CORRECTIONS)"})
    is_cap: float = field(default=2.0, metadata={
        "help": "TRL ``vllm_importance_sampling_cap``: truncation cap / mask bound of the IS ratio."})
    seed: int = field(default=0, metadata={
        "help": "seed of the run (data order, sampling, initialisation of anything random)"})
    steps: int = field(default=100, metadata={"help": "optimizer steps of GRPO"})
    prompts_per_step: int = field(default=8, metadata={
        "help": "prompts per optimizer step (each sampled num_generations times)"})
    num_generations: int = field(default=4, metadata={"help": "completions per prompt: GRPO's group"})
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate"})
    beta: float = field(default=0.0, metadata={
        "help": "KL coefficient against the reference model (TRL's beta; 0: no reference model)"})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature of the rollouts (> 0; the trainer's recompute divides its logits by it, as TRL's)"})
    top_p: float = sampling_field("top_p")
    top_k: int = sampling_field("top_k")
    logprobs: LogprobsMode = sampling_field("logprobs")
    trainer_logprobs: TrainerLogprobs = field(default="full", metadata={
        "help": "The trainer's logprob of a sampled token, in the loss and as PPO's old one: ``full`` (TRL's "
                "recompute over the whole vocabulary) or ``renormalised`` (over the sampler's kept support, vLLM's "
                "top-k/top-p rule applied to the trainer's own logits, the sampled token always in it: with "
                "truncation on, its ratio to vLLM's processed logprob is then rounding only, not the kept mass). "
                "Needs top_p < 1 or top_k > 0 and logprobs: processed. :data:`rpa.core.sampling.TRAINER_LOGPROBS`."})
    max_prompt_length: int = field(default=128, metadata={
        "help": "prompt tokens at most (longer prompts are refused when the task is built)"})
    max_completion_length: int = field(default=32, metadata={"help": "completion tokens at most"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute activations in the backward pass (less memory, more compute)"})
    per_device_train_batch_size: int | None = field(default=None, metadata={
        "help": "Completions per forward/backward micro-batch (TRL's option); ``None``: the whole step. Must divide "
                "the completions of a step; the rest is gradient accumulation."})
    gradient_accumulation_steps: int | None = field(default=None, metadata={
        "help": "Micro-batches per optimizer step; ``None``: completions per step / micro-batch size. Given together "
                "with ``per_device_train_batch_size``, their product must be the step."})
    logprob_chunk_tokens: int = field(default=1024, metadata={
        "help": "Tokens per LM-head + log-softmax chunk when the trainer scores completions "
                "(:func:`rpa.measure.scoring.token_logps_and_entropy`): bounds the full-vocabulary logits alive at "
                "once."})
    checkpoint_every: int = field(default=20, metadata={"help": "optimizer steps between checkpoints (resume points)"})
    save_total_limit: int | None = field(default=2, metadata={
        "help": "Checkpoints kept in the run directory (transformers' ``save_total_limit``): the newest N, older ones"
                " deleted once a newer one is written. A resume needs only the newest whole one "
                "(:func:`rpa.train.rundir.latest_checkpoint`); 2 keeps the one before it through a kill during a "
                "save. ``null`` keeps every checkpoint (each is FP32 weights + Adam states, ~12 bytes a parameter: ~7"
                " GB at 0.6B, ~98 GB at 8B)."})
    keep_checkpoints: bool = field(default=True, metadata={
        "help": "Keep the run's checkpoints once it has ended (its summary written). false: a finished run "
                "(ok, collapsed or diverged) deletes them -- it is done without them, and a search grid's FP32 "
                "weights and Adam states (~1.6 GB a run at 135M) would otherwise fill the disk; a run that "
                "ended in an error keeps them, to resume from once the cause is fixed."})
    eval_every: int = field(default=0, metadata={
        "help": "Score ``task.eval_prompts`` held-out prompts (greedy, by the sampler) at step 0, every this many "
                "optimizer steps (whatever ``updates_per_generation``; a resumed run keeps the cadence: the sampler "
                "gets the weights of the step first) and after the last one, into ``eval.jsonl`` (0: never)."})
    eval_timeout_s: float = field(default=7200.0, metadata={
        "help": "Seconds the other processes of a multi-process run (FSDP2) wait for rank 0's held-out evaluation, in"
                " a barrier of their own rather than in the next collective of training (whose timeout, 30 min by "
                "default, one 8B evaluation of 500 prompts x 4,096 tokens, ~20 min on an 80 GB GPU, comes close to); "
                "past it the run fails."})
    old_logprobs: OldLogprobs = field(default="trainer", metadata={
        "help": "PPO's old log-probabilities: ``trainer`` (TRL's recomputation at the sampling weights: ratio 1 on "
                "the first update) or ``sampler`` (vLLM's, as asynchronous GRPO trainers use them: the mismatch "
                'reaches the clip -- "phantom clipping").'})
    lr_scheduler_type: LrSchedule = field(default="linear", metadata={
        "help": "Learning-rate schedule over ``steps`` (transformers' ``lr_scheduler_type``): ``linear`` (TRL's "
                "default, decays to 0 at the last step), ``constant`` (as the published BF16 collapses trained), "
                "``cosine``."})
    updates_per_generation: int = field(default=1, metadata={
        "help": "Optimizer steps per generated batch: vLLM samples ``updates_per_generation x prompts_per_step`` "
                "prompts at once and the trainer takes that many steps on them in turn (TRL "
                "``steps_per_generation``), so all but the first update are off-policy (old != current)."})
    num_iterations: int = field(default=1, metadata={
        "help": "Updates on each batch (TRL ``num_iterations``, GRPO's mu): > 1 reuses a batch, so the PPO ratio "
                "moves away from 1 and the clip acts."})
    eval_temperature: float = field(default=0.0, metadata={
        "help": "Sampling temperature of the held-out evaluation (0: greedy), separate from ``temperature`` "
                "(training's)."})
    scale_rewards: ScaleRewards = field(default="group", metadata={
        "help": "TRL ``scale_rewards``: ``group`` (TRL's default: each group's rewards minus their mean, divided by "
                "the group's std, so a group whose rewards differ by 0.01 still gets unit-size advantages), ``batch``"
                " (divided by the std over the whole step) or ``none`` (centred only, Dr. GRPO). The value in effect "
                "is written to every run's summary (``grpo``)."})
    warm_start: WarmStart = field(default_factory=WarmStart, metadata={
        "help": "supervised warm start before GRPO (WarmStart)"})
    sync_check: SyncCheck = field(default_factory=SyncCheck, metadata={
        "help": "the check after every weight sync (SyncCheck)"})
    collapse: CollapseThresholds = field(default_factory=CollapseThresholds, metadata={
        "help": "the collapse rule's thresholds (rpa.train.collapse.CollapseThresholds)"})
    report_to: tuple[str, ...] = field(default=(), metadata={
        "help": "transformers' report_to integrations (empty: none)"})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={
        "help": "Share of GPU memory the colocated vLLM takes (TRL ``vllm_gpu_memory_utilization``)."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={
        "help": "Ranks per colocated vLLM engine (TRL ``vllm_tensor_parallel_size``); must divide the processes."})
    vllm_context_slack: int = field(default=8, metadata={
        "help": "Tokens of vLLM context beyond ``max_prompt_length + max_completion_length``."})
    vllm_enforce_eager: bool = field(default=False, metadata={
        "help": "Run the colocated vLLM eager (no ``torch.compile``, no CUDA graphs). Off: vLLM's default compiled "
                "engine, as deployed. On CPU the compilation costs ~30 s per run (the compile cache is keyed by the "
                "model path, and every run loads its own ``init_model``)."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "shuffle the prompts (TRL's shuffle_dataset)"})
    disable_dropout: bool = field(default=True, metadata={
        "help": "turn dropout off in the trained model (TRL's disable_dropout)"})
    rollouts: Rollouts = field(default="vllm", metadata={
        "help": "Who samples: ``vllm`` (the colocated engine) or ``trainer`` (the mismatch-free BF16 control: the "
                "trainer generates with its own compute path, so the sampling policy is the trained one up to the "
                "rounding of cached decoding vs the training forward; no vLLM engine starts, and the sampler's "
                "logprobs are the decode-time ones). :data:`ROLLOUTS`."})
    trainer_decode: TrainerDecode = field(default="cached", metadata={
        "help": "How ``rollouts: trainer`` samples: ``cached`` (KV-cached decoding, one token's forward at a time; "
                "its logprobs differ from the training forward's by rounding: 0.04 nats/token on SmolLM2 in BF16) or "
                "``recompute`` (no cache: one forward of the whole sequence so far per token, the training "
                "forward's own computation; its cost grows with the square of the length). With "
                "``attn_implementation: eager`` the sampling policy is then the trained one bit for bit where the "
                "training batch lays a row out as sampling did (the tiny models' test); SmolLM2 in TRL's padded "
                "training batches only with ``trainer_batching: per_row`` (a row padded differently keeps 74% of "
                "its tokens' bits)."})
    trainer_batching: TrainerBatching = field(default="padded", metadata={
        "help": "How the trainer lays out the sequences it scores (old logprobs and the loss) and, with ``rollouts: "
                "trainer``, samples: ``padded`` (TRL's batches: prompts padded on the left, completions on the "
                "right; with trainer rollouts the prompts of a generation sampled as one left-padded batch) or "
                "``per_row`` (each sequence alone, its padding cut off, one forward per sequence -- slower; a row's "
                "bits then do not depend on the other rows' lengths, and recompute sampling predicts each token "
                "from a head of at least two rows, as the training forward's)."})
    attn_implementation: AttnImplementation = field(default="sdpa", metadata={
        "help": "The trainer's attention kernel (transformers' ``attn_implementation``): ``sdpa`` (PyTorch's fused "
                "kernel; on CPU a row's bits depend on the sequence length it is computed in) or ``eager`` (matmul, "
                "FP32 softmax, matmul; they do not: SmolLM2 in BF16, a token's logprob at the end of its prefix "
                "equals the one inside the whole unpadded sequence, 48 of 48). vLLM's side is not changed."})

    def __post_init__(self) -> None:
        for name in ("gradient_checkpointing", "vllm_enforce_eager", "shuffle_dataset", "disable_dropout",
                     "keep_checkpoints"):
            if not isinstance(getattr(self, name), bool):
                raise TrainConfigError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        check_choices(self, TrainConfigError)  # is_correction, old_logprobs, lr_scheduler_type, scale_rewards, rollouts
        for name in ("steps", "prompts_per_step", "num_generations", "max_prompt_length", "max_completion_length",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if seed_problem(self.seed):
            raise TrainConfigError(f"seed: {seed_problem(self.seed)}")
        if self.num_generations < 2:
            raise TrainConfigError("num_generations: GRPO needs at least 2 completions per prompt")
        if not self.learning_rate > 0 or self.beta < 0 or not self.is_cap > 1:
            raise TrainConfigError("learning_rate > 0, beta >= 0 and is_cap > 1 are required")
        sampling_problem = self.sampling_problem()
        if sampling_problem:
            raise TrainConfigError(sampling_problem)
        if self.warm_start.steps < 0:
            raise TrainConfigError("warm_start.steps: must be >= 0")
        if self.logprob_chunk_tokens < 1 or self.vllm_context_slack < 0:
            raise TrainConfigError("logprob_chunk_tokens must be >= 1 and vllm_context_slack >= 0")
        for name in ("updates_per_generation", "num_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TrainConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        from rpa.core.sampling import temperature_problem

        if temperature_problem(self.eval_temperature, "eval_temperature", greedy=True):
            raise TrainConfigError(temperature_problem(self.eval_temperature, "eval_temperature", greedy=True))
        if self.trainer_decode != "cached" and self.rollouts != "trainer":
            raise TrainConfigError("trainer_decode: only rollouts: trainer decodes on the trainer (vLLM samples "
                                   "with its own engine)")
        if self.attn_implementation != "sdpa" and self.numerics.trainer_attention != "stock":
            raise TrainConfigError(f"attn_implementation: {self.attn_implementation} replaces the attention that "
                                   f"numerics.trainer_attention: {self.numerics.trainer_attention} re-rounds; use one")
        if self.attn_implementation != "sdpa" and self.beta > 0:
            raise TrainConfigError("attn_implementation: the KL reference model TRL loads (beta > 0) would keep "
                                   "sdpa; use beta 0")
        if self.rollouts == "trainer":
            if self.is_correction != "off":
                raise TrainConfigError("is_correction: an importance-sampling correction needs a second engine; "
                                       "rollouts: trainer samples from the trained policy itself")
            if self.numerics.sampler_perturbation is not None or self.numerics.aligned_sides != "both":
                raise TrainConfigError("rollouts: trainer has no separate sampler to perturb or align one-sidedly")
            if self.numerics.trainer_precision != "same":
                raise TrainConfigError("rollouts: trainer has no vLLM engine to run the precision beside an FP32 "
                                       "trainer (numerics.trainer_precision: fp32); for an FP32 run use "
                                       "precision: fp32")
            if self.vllm_tensor_parallel_size != 1:
                raise TrainConfigError("rollouts: trainer starts no vLLM engine; vllm_tensor_parallel_size must be 1")
        if self.old_logprobs == "sampler" and self.is_correction != "off":
            raise TrainConfigError(
                f"is_correction: {self.is_correction} with old_logprobs: sampler applies the correction twice (PPO's "
                f"ratio is then already pi / mu, and TRL multiplies the loss by its clipped pi_old / mu again); "
                f"use one of them")
        if self.save_total_limit is not None and (isinstance(self.save_total_limit, bool)
                                                  or not isinstance(self.save_total_limit, int)
                                                  or self.save_total_limit < 1):
            raise TrainConfigError(f"save_total_limit: must be an integer >= 1 (or null: keep every checkpoint), "
                                   f"got {self.save_total_limit!r}")
        if self.eval_every < 0:
            raise TrainConfigError("eval_every: must be >= 0")
        if isinstance(self.eval_timeout_s, bool) or not isinstance(self.eval_timeout_s, (int, float)) \
                or not self.eval_timeout_s > 0:
            raise TrainConfigError(f"eval_timeout_s: must be a number > 0, got {self.eval_timeout_s!r}")
        if self.eval_every and not self.task.eval_prompts:
            raise TrainConfigError("eval_every: needs task.eval_prompts > 0")
        if self.eval_every and self.vllm_tensor_parallel_size > 1:
            raise TrainConfigError("eval_every: the held-out evaluation runs on rank 0's engine alone, which a "
                                   "tensor-parallel sampler (vllm_tensor_parallel_size > 1) cannot do; "
                                   "set eval_every 0")
        if self.vllm_tensor_parallel_size < 1:
            raise TrainConfigError("vllm_tensor_parallel_size: must be >= 1")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise TrainConfigError("vllm_gpu_memory_utilization: must be in (0, 1]")
        if self.report_to:
            problem = report_to_problem(self.report_to)
            if problem:
                raise TrainConfigError(f"report_to: {problem}")
        if self.numerics.device != "auto":
            raise TrainConfigError("numerics.device: training places the model where accelerate does; leave it 'auto'")
        self.micro_batching()  # raises on a split that does not add up
        batch = self.prompts_per_step * self.updates_per_generation
        if self.task.name in SYNTHETIC and self.task.num_prompts < batch:
            raise TrainConfigError(f"task.num_prompts: {self.task.num_prompts} prompts cannot fill one generation of "
                                   f"{batch} (prompts_per_step x updates_per_generation); the run would train nothing")

    @property
    def sampling(self):
        """The rollouts' :class:`~rpa.core.sampling.SamplingSettings` (temperature, top_p, top_k, logprobs)."""
        return settings_of(self)

    def sampling_problem(self) -> str | None:
        """Why the sampling settings cannot train as configured, in one line (None if they can): a value out of
        range, an option with no meaning here, or a loss biased by what the sampler's logprob leaves out."""
        from rpa.core.sampling import SamplingSettings

        problem = SamplingSettings.problem(self)  # the one check of the values, on this config's fields
        if problem:
            return problem
        truncates = self.sampling.truncates
        if self.trainer_logprobs == "renormalised" and (not truncates or self.logprobs != "processed"):
            return ("trainer_logprobs: renormalised renormalises over the tokens top_p/top_k keep, in vLLM's processed "
                    "logprobs; it needs top_p < 1 or top_k > 0 and logprobs: processed")
        if self.rollouts == "trainer" and (truncates or self.logprobs != "processed"):
            return ("rollouts: trainer samples at the temperature alone and reports untruncated logprobs; top_p, top_k "
                    "and logprobs: raw need the vLLM sampler")
        in_loss = self.is_correction != "off" or self.old_logprobs == "sampler"
        if in_loss and self.logprobs == "raw" and (self.temperature != 1 or truncates):
            return ("logprobs: raw with vLLM's logprobs in the loss (is_correction or old_logprobs: sampler) biases the "
                    "ratio by the temperature and truncation the raw logprob leaves out (TRL #4159); use logprobs: "
                    "processed")
        if in_loss and truncates and self.trainer_logprobs == "full":
            return ("top_p/top_k with vLLM's logprobs in the loss (is_correction or old_logprobs: sampler) biases the "
                    "ratio by the kept probability mass (TRL #6789); set trainer_logprobs: renormalised")
        return None

    def micro_batching(self, world_size: int = 1) -> tuple[int, int]:
        """``(per_device_train_batch_size, gradient_accumulation_steps)`` of one optimizer step
        on ``world_size`` processes: their product times ``world_size`` is the step's completions."""
        total = self.completions_per_step
        if total % world_size:
            raise TrainConfigError(f"the completions per step ({total}) do not split over {world_size} processes")
        per_rank = total // world_size
        size, accumulate = self.per_device_train_batch_size, self.gradient_accumulation_steps
        if size is None:
            size = per_rank // (accumulate or 1)
        accumulate = accumulate or per_rank // max(size, 1)
        if size < 1 or accumulate < 1 or size * accumulate != per_rank:
            raise TrainConfigError(f"per_device_train_batch_size x gradient_accumulation_steps x processes must equal "
                                   f"the completions per step ({self.prompts_per_step} prompts x "
                                   f"{self.num_generations} generations = {total}); got "
                                   f"{self.per_device_train_batch_size} x {self.gradient_accumulation_steps} x "
                                   f"{world_size}")
        return size, accumulate

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        if not isinstance(data, dict):
            raise TrainConfigError("a run config is a mapping")
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainConfigError(f"unknown key(s) {', '.join(unknown)}{_did_you_mean(unknown, known)}; "
                                   f"valid: {', '.join(sorted(known))}")
        if "model" not in data:
            raise TrainConfigError("model: required (local directory or hub id)")
        nested = {"task": TaskSpec, "warm_start": WarmStart, "sync_check": SyncCheck, "collapse": CollapseThresholds}
        for key, kind in nested.items():
            if key in data:
                data[key] = _build(kind, data[key], key)
        if "numerics" in data:
            try:
                data["numerics"] = NumericsConfig.from_dict(data["numerics"])
            except NumericsConfigError as err:
                raise TrainConfigError(f"numerics: {err}") from None
        try:
            data = typed(cls, data)
        except FieldTypeError as err:
            raise TrainConfigError(str(err)) from None
        try:
            return cls(**data)
        except TypeError as err:
            raise TrainConfigError(str(err)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TrainConfig":
        from rpa.core.yamlfiles import YamlError, load_yaml

        try:
            data = load_yaml(path)  # a duplicate key refused; an error in one line with line and column
        except YamlError as err:
            raise TrainConfigError(str(err)) from None
        try:
            return cls.from_dict(data)
        except TrainConfigError as err:
            raise TrainConfigError(f"{path}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["numerics"] = self.numerics.to_dict()
        out["report_to"] = list(self.report_to)
        return out

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations


REPORT_PACKAGES = {"comet_ml": "comet_ml", "mlflow": "mlflow", "neptune": "neptune", "tensorboard": "tensorboard",
                   "trackio": "trackio", "wandb": "wandb", "codecarbon": "codecarbon", "clearml": "clearml",
                   "dagshub": "dagshub", "flyte": "flytekit", "dvclive": "dvclive", "swanlab": "swanlab",
                   "azure_ml": "azureml", "kubeflow": "kubeflow"}
"""The package each of transformers' reporting targets needs (a target that is not installed fails
inside transformers, after the engines started)."""


def report_to_problem(targets: tuple[str, ...]) -> str | None:
    """Why ``report_to`` cannot work here: a target transformers does not know, or one whose package
    is not installed (checked from the target names; transformers' integrations are not imported)."""
    import importlib.util

    unknown = [t for t in targets if t not in REPORT_PACKAGES and t not in ("none", "all")]
    if unknown:
        return (f"unknown target(s) {', '.join(map(repr, unknown))}{_did_you_mean(unknown, set(REPORT_PACKAGES))}; "
                f"valid: {', '.join(sorted(REPORT_PACKAGES))}")
    missing = [t for t in targets if t in REPORT_PACKAGES and importlib.util.find_spec(REPORT_PACKAGES[t]) is None]
    if missing:
        return f"{', '.join(missing)}: the package {REPORT_PACKAGES[missing[0]]!r} is not installed"
    return None


def _did_you_mean(unknown: list[str], known: set[str]) -> str:
    import difflib

    guesses = [g for u in unknown for g in difflib.get_close_matches(u, known, n=1)]
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


def _build(kind, value: Any, key: str):
    if not isinstance(value, dict):
        raise TrainConfigError(f"{key}: must be a mapping")
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise TrainConfigError(f"{key}: unknown key(s) {', '.join(unknown)}{_did_you_mean(unknown, names)}; "
                               f"valid: {', '.join(sorted(names))}")
    try:
        return kind(**typed(kind, value, prefix=f"{key}."))
    except FieldTypeError as err:
        raise TrainConfigError(str(err)) from None
    except (TaskError, ValueError, TypeError) as err:
        raise TrainConfigError(f"{key}: {err}") from None
