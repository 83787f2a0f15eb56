"""The central measurement: trainer vs sampler log-probabilities of the same tokens.

Used by the probe, parity, diagnose and the GRPO runner alike:

* completions I/O (:func:`sample_completions`, :func:`save_completions`,
  :func:`load_completions`): ``{"seq", "prompt_ids", "completion_ids"}`` records, JSON lines;
* μ, the sampler: :func:`sampler_logprobs` (vLLM ``prompt_logprobs`` of fixed tokens);
* π, the trainer: :func:`trainer_logprobs` (one sequence, no padding),
  :func:`trainer_batch_logprobs` (a padded batch laid out as TRL lays it out) and
  :func:`token_logps_and_entropy` (the GRPO runner's scoring: micro-batches, and the LM
  head + FP32 log-softmax in chunks of tokens, so memory does not grow with the
  vocabulary times the whole step);
* :func:`sync_gap`: both on one sequence, after a weight sync.

Trainer log-softmax is taken in FP32, as vLLM takes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rpa.core.errors import UserError

LOGPROB_CHUNK_TOKENS = 1024
"""Default tokens per LM-head + log-softmax chunk in :func:`token_logps_and_entropy`
(1024 x 151,936 FP32 logits = 0.6 GB); a run config sets its own."""


class CompletionsError(UserError):
    """A completions file that cannot be scored (empty, not JSON lines, missing keys)."""


# ---------------------------------------------------------------------- completions


def sample_completions(llm, prompts: list[str], samples: int, max_tokens: int,
                       sampling=None) -> list[dict[str, Any]]:
    """Samples with vLLM's decode-time logprob of each sampled token (``logp_decode``: raw or processed
    as the engine's ``logprobs_mode`` says); ``sampling``: the :class:`~rpa.core.sampling.SamplingSettings`
    (default: temperature 1, no truncation)."""
    from vllm import SamplingParams

    truncation = {} if sampling is None or not sampling.truncates else \
        {"top_p": sampling.top_p, "top_k": sampling.top_k}  # vLLM's defaults (off) otherwise
    params = SamplingParams(n=samples, temperature=1.0 if sampling is None else sampling.temperature,
                            max_tokens=max_tokens, logprobs=0, **truncation)
    completions = []
    for result in llm.generate(prompts, params, use_tqdm=False):
        for c in result.outputs:
            ids = list(c.token_ids)
            completions.append({"seq": len(completions), "prompt_ids": list(result.prompt_token_ids),
                                "completion_ids": ids,
                                "logp_decode": [lp[t].logprob for lp, t in zip(c.logprobs, ids)]})
    return [c for c in completions if c["completion_ids"]]


def save_completions(path: Path, completions: list[dict[str, Any]]) -> None:
    from rpa.core.jsonfiles import write_text

    write_text(path, "".join(json.dumps(c) + "\n" for c in completions))  # atomic


def load_completions(path: str | Path) -> list[dict[str, Any]]:
    """Completions written by :func:`save_completions` (``logp_decode`` is dropped: it
    belongs to the configuration that sampled them)."""
    path = Path(path)
    if path.is_dir():
        raise CompletionsError(f"{path}: is a directory, not a completions file")
    if not path.is_file():
        raise CompletionsError(f"{path}: no such file")
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise CompletionsError(f"{path}: not a text file (completions are JSON lines)") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            c = json.loads(line)
        except json.JSONDecodeError as err:
            raise CompletionsError(f"{path}:{n}: not a JSON line ({err.msg})") from None
        if not isinstance(c, dict):
            raise CompletionsError(f"{path}:{n}: expected a JSON object, got {type(c).__name__}")
        missing = {"seq", "prompt_ids", "completion_ids"} - set(c)
        if missing:
            raise CompletionsError(f"{path}:{n}: missing key(s) {', '.join(sorted(missing))} "
                                   f"(records need seq, prompt_ids, completion_ids)")
        if isinstance(c["seq"], bool) or not isinstance(c["seq"], int):
            raise CompletionsError(f"{path}:{n}: seq must be an integer (the record's index), got {c['seq']!r}")
        if not (isinstance(c["prompt_ids"], list) and isinstance(c["completion_ids"], list)) or \
                not (c["prompt_ids"] and c["completion_ids"]) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in c["prompt_ids"] + c["completion_ids"]):
            raise CompletionsError(f"{path}:{n}: prompt_ids and completion_ids must be non-empty lists of "
                                   f"token ids")
        out.append({k: c[k] for k in ("seq", "prompt_ids", "completion_ids")})
    if not out:
        raise CompletionsError(f"{path}: no completions (empty file)")
    return out


# -------------------------------------------------------------------- the sampler, μ


def sampler_logprobs(llm, completions, top_k: int | None) -> tuple[list[list[float]], list[np.ndarray] | None]:
    """vLLM's logprob of every completion token via ``prompt_logprobs``; with ``top_k`` =
    vocabulary size also the full log-distribution at each completion position."""
    from vllm import SamplingParams

    # flat_logprobs + no detokenizing: a full-vocabulary row is a slice of flat arrays,
    # not `vocab` Python objects (15x faster on the tiny models).
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=top_k or 0, flat_logprobs=True,
                            detokenize=False)
    inputs = [{"prompt_token_ids": c["prompt_ids"] + c["completion_ids"]} for c in completions]
    logps, dists = [], [] if top_k else None
    for c, result in zip(completions, llm.generate(inputs, params, use_tqdm=False)):
        flat, start, ids = result.prompt_logprobs, len(c["prompt_ids"]), c["completion_ids"]
        token_ids, values = np.asarray(flat.token_ids), np.asarray(flat.logprobs, dtype=np.float64)
        picked, dist = [], np.full((len(ids), top_k or 1), -np.inf)
        for j, tok in enumerate(ids):
            lo, hi = flat.start_indices[start + j], flat.end_indices[start + j]
            row_ids, row_lp = token_ids[lo:hi], values[lo:hi]
            hit = np.flatnonzero(row_ids == tok)
            if hit.size == 0:
                raise RuntimeError(f"vLLM returned no logprob for completion token {tok} of sequence {c['seq']}")
            picked.append(float(row_lp[hit[0]]))
            if top_k:
                dist[j, row_ids] = row_lp
                if np.isneginf(dist[j]).any():
                    raise RuntimeError(f"vLLM returned {np.isfinite(dist[j]).sum()} of {top_k} logprobs; "
                                       f"cannot compute full_kl")
        logps.append(picked)
        if top_k:
            dists.append(dist)
    return logps, dists


def sampler_split_tokens(llm, completions, vocab: int, settings) -> list[list[Any]]:
    """The sampler's raw, temperature-scaled and processed logprob of every completion token
    (:class:`~rpa.core.sampling.SamplerToken`), from its whole raw distribution at each position
    (``prompt_logprobs`` over the vocabulary, one sequence at a time so that only one sequence's
    distributions are held). Needs an engine started with ``max_logprobs`` >= ``vocab``."""
    import torch

    from rpa.core.sampling import sampler_token

    out = []
    for c in completions:
        _, dists = sampler_logprobs(llm, [c], vocab)
        raw = torch.from_numpy(dists[0])  # raw logprobs: logits up to a constant per position
        out.append([sampler_token(raw[j], tok, settings) for j, tok in enumerate(c["completion_ids"])])
    return out


# -------------------------------------------------------------------- the trainer, π


def trainer_recompute_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float):
    """The trainer's recompute of each completion token at ``temperature``, over the whole vocabulary
    (one sequence, no padding): what TRL's loss sees (:func:`rpa.core.sampling.recompute_logprobs`)."""
    import torch

    from rpa.core.sampling import recompute_logprobs

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + completion_ids], device=device)
    with torch.no_grad():
        logp = recompute_logprobs(model(ids).logits[0, len(prompt_ids) - 1: -1], temperature)
    return logp.gather(-1, ids[0, len(prompt_ids):, None])[:, 0].tolist()



def trainer_token_stats(model, prompt_ids: list[int], completion_ids: list[int], *, full: bool = False):
    """``(logps, entropies, dists)`` of one sequence (no padding): the trainer's log-probability
    of each completion token given everything before it, the entropy (nats) of its next-token
    distribution at that position, and with ``full`` the FP32 log-distributions (else None)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + completion_ids], device=device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float()[0, len(prompt_ids) - 1: -1], dim=-1)
    picked = logp.gather(-1, ids[0, len(prompt_ids):, None])[:, 0].tolist()
    entropy = (-(logp.exp() * logp).sum(-1)).tolist()
    return picked, entropy, (logp.double().cpu().numpy() if full else None)


def trainer_logprobs(model, prompt_ids: list[int], completion_ids: list[int], *, full: bool = False):
    """Trainer log-probability of each completion token given everything before it
    (one sequence, no padding). With ``full`` also the FP32 log-distributions."""
    picked, _, dist = trainer_token_stats(model, prompt_ids, completion_ids, full=full)
    return (picked, dist) if full else picked


def trainer_decode_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """The trainer's own KV-cached decoding of one sequence (no padding), teacher-forced: the prompt
    in one forward, then each completion token in a forward of its own on the cache, the last
    position's FP32 log-softmax scoring the next token -- the path ``model.generate`` samples with
    (``rollouts: trainer``). :func:`trainer_logprobs` scores the same tokens in one forward of the
    whole sequence, as training does; where the two differ, the trainer disagrees with itself."""
    import torch

    device = next(model.parameters()).device
    picked = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
        for step, token in enumerate(completion_ids):
            # the next token's log-probability at the last position, the rounding as at sampling time
            picked.append(float(torch.log_softmax(out.logits[0, -1].float(), dim=-1)[token]))
            if step + 1 < len(completion_ids):
                out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=out.past_key_values,
                            use_cache=True)
    return picked


def trl_batch(completions, pad_id: int):
    """``completions`` (each with ``prompt_ids`` and ``completion_ids``) laid out as TRL lays out a
    batch: prompts padded on the left, completions on the right, ``pad_id`` in between. The ids, the
    attention mask and the completions' width (the scored positions at the end of each row)."""
    import torch

    p_len = max(len(c["prompt_ids"]) for c in completions)
    c_len = max(len(c["completion_ids"]) for c in completions)
    ids = torch.full((len(completions), p_len + c_len), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(completions):
        p, y = c["prompt_ids"], c["completion_ids"]
        ids[i, p_len - len(p): p_len] = torch.tensor(p)
        ids[i, p_len: p_len + len(y)] = torch.tensor(y)
        mask[i, p_len - len(p): p_len + len(y)] = 1
    return ids, mask, c_len


def trainer_batch_logprobs(model, completions, pad_id: int, batch_size: int | None = None,
                           chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> list[list[float]]:
    """All sequences laid out as TRL lays out a batch: prompts left-padded, completions
    right-padded, an attention mask and no ``position_ids``; scored through the training path
    (:func:`token_logps_and_entropy`: micro-batches of ``batch_size``, default all at once, and
    the LM head + FP32 log-softmax ``chunk_tokens`` tokens at a time), so memory does not grow
    with sequences x tokens x vocabulary (256 completions of ~500 tokens at Qwen3's 151,936
    vocabulary would be 41 GB of BF16 logits at once)."""
    import torch

    device = next(model.parameters()).device
    ids, mask, c_len = trl_batch(completions, pad_id)
    with torch.no_grad():
        logp, _ = token_logps_and_entropy(model, ids.to(device), mask.to(device), c_len, batch_size=batch_size,
                                          chunk_tokens=chunk_tokens)
    return [logp[i, : len(c["completion_ids"])].tolist() for i, c in enumerate(completions)]


def sync_gap(llm, model, ids: list[int]) -> tuple[float, list[float], list[float]]:
    """Mean |log π − log μ| over the tokens of ``ids`` (vLLM ``prompt_logprobs`` vs ``model``),
    and both engines' logprobs themselves (μ, π). Scored as the probe scores fixed tokens."""
    seq = {"seq": 0, "prompt_ids": ids[:1], "completion_ids": ids[1:]}
    mu = sampler_logprobs(llm, [seq], None)[0][0]
    pi = trainer_logprobs(model, seq["prompt_ids"], seq["completion_ids"])
    return sum(abs(a - b) for a, b in zip(pi, mu)) / len(mu), mu, pi


@dataclass(frozen=True)
class Transforms:
    """What the trainer's scoring does beyond TRL's recompute at the sampling temperature (``None``
    where: the recompute, bit for bit as before): ``renormalise`` -- each token's logprob over the
    sampler's kept support (:func:`rpa.core.sampling.renormalised_logprobs`, ``trainer_logprobs:
    renormalised``); ``parts`` -- also each token's full recompute, its non-rounding part of the gap to
    the sampler's report and whether it fell outside the kept set (:func:`rpa.core.sampling.transform_part`:
    the per-step split of ``rpa train``). ``settings`` are the sampler's (its temperature is the recompute's)."""

    settings: Any
    renormalise: bool = False
    parts: bool = False

    @property
    def columns(self) -> int:
        """Columns of the scoring head's output: logprob, entropy, and with ``parts`` recompute, part, outside."""
        return 5 if self.parts else 2


def _head_logps(head, hidden, targets, temperature: float, entropy: bool, transforms: Transforms | None = None):
    """LM head + FP32 log-softmax of one chunk of tokens: picked log-probs (and entropies), and with
    ``transforms`` their renormalised form and the gap's non-rounding part (:class:`Transforms`)."""
    import torch

    from rpa.core.sampling import recompute_logprobs

    logits = head(hidden).float()
    logp = recompute_logprobs(logits, temperature)  # FP32 log softmax(l / T) over the vocabulary, as TRL's
    picked = logp.gather(-1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1) if entropy else None  # of the whole distribution, as TRL's
    if transforms is None:
        return picked, ent
    from rpa.core.sampling import kept_support, renormalised_logprobs, transform_part

    settings, recompute = transforms.settings, picked
    keep, outside = kept_support(logits, targets, settings) if settings.truncates else (None, None)
    if transforms.renormalise:
        picked = renormalised_logprobs(logits, targets, settings, keep)
    if not transforms.parts:
        return picked, ent
    with torch.no_grad():
        part = transform_part(logits, targets, settings, keep, recompute=logp)
        out = torch.zeros_like(part, dtype=torch.bool) if outside is None else outside
    return picked, ent, recompute.detach(), part, out.to(part.dtype)


def _inner_model(model):
    """The causal LM inside a DDP wrapper (an FSDP2-sharded model is the module itself)."""
    import torch

    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class _ChunkedHead:
    """Stands in for the LM head's forward during one scoring forward: the model's own forward
    (with a DDP wrapper's or FSDP2's hooks around it, so gradients sync and sharded parameters
    are gathered) hands it the hidden states of the kept positions, and it returns
    ``(batch, kept - 1, 2)``: each position's log-probability of the next token and its entropy
    (0 when not asked for), the head + FP32 log-softmax run ``chunk_tokens`` tokens at a time
    and recomputed in the backward pass, so no more than one chunk of full-vocabulary logits is
    alive. Wrapped or not, every caller scores through this one path (π_old and π agree bitwise)."""

    def __init__(self, stock, targets, temperature: float, entropy: bool, chunk_tokens: int,
                 transforms: Transforms | None = None) -> None:
        self.stock, self.targets, self.temperature = stock, targets, temperature
        self.entropy, self.chunk_tokens, self.transforms = entropy, chunk_tokens, transforms

    def __call__(self, hidden):
        import torch
        from torch.utils.checkpoint import checkpoint

        batch, width = hidden.size(0), hidden.size(-1)
        hidden = hidden[:, :-1].reshape(-1, width)  # the positions predicting the kept tokens
        columns = [[] for _ in range(2 if self.transforms is None else self.transforms.columns)]
        for lo in range(0, self.targets.numel(), self.chunk_tokens):
            args = (self.stock, hidden[lo:lo + self.chunk_tokens], self.targets[lo:lo + self.chunk_tokens],
                    self.temperature, self.entropy, self.transforms)
            if torch.is_grad_enabled() and hidden.requires_grad:
                got = checkpoint(_head_logps, *args, use_reentrant=False)
            else:
                got = _head_logps(*args)
            for column, value in zip(columns, got):
                column.append(value if value is not None else torch.zeros_like(got[0]))
        return torch.stack([torch.cat(c) for c in columns], dim=-1).view(batch, -1, len(columns))


def token_logps_and_entropy_per_row(model, input_ids, attention_mask, logits_to_keep: int,
                                    temperature: float = 1.0, compute_entropy: bool = False,
                                    chunk_tokens: int = LOGPROB_CHUNK_TOKENS, transforms: Transforms | None = None):
    """:func:`token_logps_and_entropy` of each sequence alone, its padding cut off: one forward per
    row of the tokens its ``attention_mask`` keeps (one contiguous span: prompts padded on the left,
    completions on the right), so that a row's bits do not depend on how long the other rows of its
    batch are. The padded positions of the last ``logits_to_keep`` get 0 (they are masked out)."""
    import torch

    rows = []
    for row in range(input_ids.size(0)):
        kept = attention_mask[row].nonzero()[:, 0]
        start, end = (int(kept[0]), int(kept[-1]) + 1) if kept.numel() else (0, 0)
        completion = max(0, end - (input_ids.size(1) - logits_to_keep))  # kept tokens among the scored
        if completion == 0:  # nothing of this row is scored: no forward
            columns = 2 if transforms is None else transforms.columns
            scored = torch.zeros(1, 0, columns, device=input_ids.device)
        else:
            ids = input_ids[row:row + 1, start:end]
            scored = _score(model, ids, torch.ones_like(ids), completion, temperature, compute_entropy, chunk_tokens,
                            transforms)
        rows.append(torch.nn.functional.pad(scored, (0, 0, 0, logits_to_keep - completion)))
    return _split(torch.cat(rows), compute_entropy, transforms)


def token_logps_and_entropy(model, input_ids, attention_mask, logits_to_keep: int, temperature: float = 1.0,
                            batch_size: int | None = None, compute_entropy: bool = False,
                            chunk_tokens: int = LOGPROB_CHUNK_TOKENS, transforms: Transforms | None = None):
    """Per-token log-probabilities (and entropies) of the last ``logits_to_keep`` tokens.

    Sequences go through the model's own forward in micro-batches of ``batch_size`` (through
    a DDP wrapper or FSDP2's hooks where the model has them); the model's own LM head (so it
    runs in the configured numerics: BF16 in compute mode, FP32 with ``lm_head_fp32``; TRL
    1.16's fused head would multiply by the FP32 master) and the FP32 log-softmax run on
    ``chunk_tokens`` tokens at a time inside that forward (:class:`_ChunkedHead`), each chunk
    recomputed in the backward pass when gradients are on, so at most one chunk of
    full-vocabulary logits is alive at a time instead of ``batch x tokens x vocabulary``.
    With ``transforms`` (:class:`Transforms`) the logprobs are renormalised over the sampler's kept
    support where it asks, and where it asks for ``parts`` a third value comes back, ``(batch, tokens,
    3)``: each token's full recompute, the non-rounding part of its gap, and 1 where it was outside the
    kept set.
    """
    import torch

    batch_size = batch_size or input_ids.size(0)
    scored = [_score(model, input_ids[start:start + batch_size], attention_mask[start:start + batch_size],
                     logits_to_keep, temperature, compute_entropy, chunk_tokens, transforms)
              for start in range(0, input_ids.size(0), batch_size)]
    return _split(torch.cat(scored), compute_entropy, transforms)


def _split(scored, compute_entropy: bool, transforms: Transforms | None):
    """The columns of :class:`_ChunkedHead`'s output as :func:`token_logps_and_entropy` returns them."""
    got = (scored[..., 0], scored[..., 1] if compute_entropy else None)
    return got + (scored[..., 2:],) if transforms is not None and transforms.parts else got


def _score(model, ids, mask, logits_to_keep: int, temperature: float, compute_entropy: bool, chunk_tokens: int,
           transforms: Transforms | None):
    """One micro-batch through the model's forward with :class:`_ChunkedHead` as its LM head's."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    head = _inner_model(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(_inner_model(model)).__name__} has no LM head to score tokens with")
    own_forward = head.__dict__.get("forward")  # an alignment's patched forward lives on the instance
    try:
        head.forward = _ChunkedHead(own_forward or type(head).forward.__get__(head),
                                    ids[:, -logits_to_keep:].reshape(-1), temperature, compute_entropy,
                                    chunk_tokens, transforms)
        return model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=logits_to_keep + 1).logits
    finally:
        if own_forward is None:
            head.__dict__.pop("forward", None)
        else:
            head.forward = own_forward
