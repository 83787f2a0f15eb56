"""Did an FP32 master learn what its BF16 rounding does not show? One checkpoint's greedy held-out evaluation on
three sides, on the same prompt token ids:

    python -m analysis.master_eval --run RUN_DIR --checkpoint checkpoint-36 --out RUN_DIR/master_eval.json
    python -m analysis.master_eval --run RUN_DIR --initial --out RUN_DIR/master_eval_step0.json

- ``engine``: the run's own sampler -- vLLM at the run's numerics (BF16: the checkpoint's FP32 master rounded to
  BF16 as the engine loads it), compiled unless the run was eager: what the run's ``eval.jsonl`` measured;
- ``trainer_fp32``: the FP32 master itself, greedy on the HF trainer in FP32 (no rounding anywhere);
- ``trainer_bf16``: the same rounded BF16 weights as the engine, greedy on the HF trainer with BF16 compute (the
  precision grid's stock trainer): separates "the rounding of the weights" (trainer_fp32 vs trainer_bf16) from "the
  engine's kernels" (trainer_bf16 vs engine).

The weight-grid lag -- updates that move the FP32 master without crossing a BF16 rounding boundary, so the BF16
engine does not see them (as LoRA updates merged onto BF16 base weights, NeMo-RL #3696, TRL #6688) -- shows as
``trainer_fp32`` above ``trainer_bf16`` and ``engine``. ``--initial`` evaluates the run's starting model the same
way (its weights are a BF16-exact conversion or near it: the sides must agree there up to their kernels).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from analysis.refusal import Refused, run


SIDES = ("engine", "trainer_fp32", "trainer_bf16")


def _score(task, rows, texts, ids) -> dict:
    rewards = task.reward([r["prompt"] for r in rows], texts, answer=[r["answer"] for r in rows], completion_ids=ids)
    correct = [bool(task.correct(t, r["answer"], i, prompt=r["prompt"])) for t, r, i in zip(texts, rows, ids)]
    return {"greedy_reward": float(sum(rewards) / len(rewards)), "greedy_accuracy": sum(correct) / len(correct),
            "mean_length": sum(map(len, ids)) / len(ids), "correct": correct}


def _hf_greedy(model: str, numerics, prompt_ids: list[list[int]], max_tokens: int, eos: int) -> list[list[int]]:
    """Greedy completions on the HF trainer at ``numerics``, one prompt at a time (no padding), KV-cached."""
    import torch

    from rpa.sides.trainer import load_trainer_model, trainer_context

    hf, alignment = load_trainer_model(numerics, model)
    out = []
    try:
        with torch.no_grad(), trainer_context(numerics):
            for ids in prompt_ids:
                gen = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos,
                                  pad_token_id=eos, top_p=None, top_k=None, temperature=None)
                tokens = gen[0, len(ids):].tolist()
                out.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    finally:
        alignment.remove()
    return out


def master_eval(run_dir: Path, checkpoint: str | None) -> dict:
    from transformers import AutoTokenizer

    from analysis.runs import run_config
    from rpa.core.numerics_config import NumericsConfig
    from rpa.measure.prompts import render_rows
    from rpa.sides.engine import close_llm, make_llm, release_memory
    from rpa.train.config import TrainConfig
    from rpa.train.tasks import build_task

    cfg = TrainConfig.from_dict(run_config(run_dir))
    model = cfg.model if checkpoint is None else str(run_dir / checkpoint)
    if not (Path(model) / "config.json").is_file():
        raise Refused(f"master_eval: {model} is not a checkpoint (no config.json); name one the run kept")
    if not cfg.task.eval_prompts:
        raise Refused("master_eval: the run's task has no held-out prompts (task.eval_prompts: 0)")
    task = build_task(cfg.task)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = render_rows(task.eval_rows, tokenizer)
    engine_numerics = cfg.numerics
    llm = make_llm(model, engine_numerics, enforce_eager=cfg.vllm_enforce_eager, seed=cfg.seed,
                   max_model_len=cfg.max_prompt_length + cfg.max_completion_length + cfg.vllm_context_slack)
    from vllm import SamplingParams

    outs = llm.generate([r["prompt"] for r in rows], SamplingParams(temperature=0.0, max_tokens=cfg.max_completion_length),
                        use_tqdm=False)
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    completions = {"engine": [list(o.outputs[0].token_ids) for o in outs]}
    close_llm(llm)
    del llm
    release_memory()
    eos = tokenizer.eos_token_id
    stock = {k: v for k, v in engine_numerics.to_dict().items() if k != "trainer_precision"}
    completions["trainer_fp32"] = _hf_greedy(model, NumericsConfig.from_dict({**stock, "regions": "none",
                                                                               "precision": "fp32"}),
                                             prompt_ids, cfg.max_completion_length, eos)
    completions["trainer_bf16"] = _hf_greedy(model, NumericsConfig.from_dict(stock), prompt_ids,
                                             cfg.max_completion_length, eos)
    result = {"run": str(run_dir), "checkpoint": checkpoint or "initial", "model": model, "prompts": len(rows),
              "engine_mode": "eager" if cfg.vllm_enforce_eager else "compiled", "engine_numerics": engine_numerics.to_dict(),
              "sides": {}}
    for side in SIDES:
        texts = tokenizer.batch_decode(completions[side], skip_special_tokens=True)
        result["sides"][side] = {**_score(task, rows, texts, completions[side]), "completion_ids": completions[side]}
    for a, b in (("trainer_fp32", "trainer_bf16"), ("trainer_bf16", "engine"), ("trainer_fp32", "engine")):
        same = sum(x == y for x, y in zip(completions[a], completions[b]))
        result[f"identical_{a}_vs_{b}"] = same / len(rows)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="a run directory (its config.json gives the task)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a checkpoint the run kept, e.g. checkpoint-36")
    which.add_argument("--initial", action="store_true", help="the run's starting model instead")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    from rpa.core.jsonfiles import write_json

    result = master_eval(args.run, None if args.initial else args.checkpoint)
    write_json(args.out, result)
    print("master_eval: " + ", ".join(f"{side} {result['sides'][side]['greedy_accuracy']:.3f}" for side in SIDES)
          + f" (greedy accuracy, {result['prompts']} held-out prompts) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
