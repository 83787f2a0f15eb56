"""Why does a run's greedy held-out evaluation fail? The sampler's greedy decode and the trainer's
argmax under teacher forcing, on the same checkpoint and prompts.

    python -m analysis.greedy_probe --run RUN_DIR --checkpoint checkpoint-40 --regions all --out F.json

The run's own config (``RUN_DIR/config.json``) gives the task's held-out prompts, the completion
cap and the engine mode (compiled unless ``vllm_enforce_eager``); ``--regions`` the numerics both
sides run (the region set is fixed per process, so each region set is its own invocation). Writes:
the greedy reward and accuracy of vLLM's decode, and, feeding vLLM's greedy tokens back through the
trainer, the share of completion positions where the trainer's argmax is vLLM's token, the first
position where they part per prompt, and the trainer's top-1 / top-2 logit margin there. A policy
whose greedy path is degenerate fails under either region set on the same weights; a defect of the
aligned greedy path fails only under ``all``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from analysis.refusal import run


def greedy_probe(run: Path, checkpoint: str, regions: str) -> dict:
    import torch

    from rpa.core.numerics_config import NumericsConfig
    from rpa.measure.prompts import render_rows
    from rpa.sides.engine import close_llm, make_llm, release_memory
    from rpa.sides.trainer import load_trainer_model
    from rpa.train.config import TrainConfig
    from rpa.train.tasks import build_task

    from analysis.runs import run_config

    cfg = TrainConfig.from_dict(run_config(run))
    model = str(run / checkpoint)
    numerics = NumericsConfig.from_dict({**cfg.numerics.to_dict(), "regions": regions})
    task = build_task(cfg.task)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = render_rows(task.eval_rows, tokenizer)
    llm = make_llm(model, numerics, enforce_eager=cfg.vllm_enforce_eager, seed=cfg.seed,
                   max_model_len=cfg.max_prompt_length + cfg.max_completion_length + cfg.vllm_context_slack)
    from vllm import SamplingParams

    outs = llm.generate([r["prompt"] for r in rows], SamplingParams(temperature=0.0, max_tokens=cfg.max_completion_length),
                        use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    greedy = [list(o.outputs[0].token_ids) for o in outs]
    rewards = task.reward([r["prompt"] for r in rows], texts, answer=[r["answer"] for r in rows], completion_ids=greedy)
    close_llm(llm)
    del llm
    release_memory()
    hf, alignment = load_trainer_model(numerics, model)
    agree, total, parts = 0, 0, []
    with torch.no_grad():
        for p, g in zip(prompt_ids, greedy):
            logits = hf(torch.tensor([p + g])).logits[0, len(p) - 1: len(p) + len(g) - 1].float()
            top = logits.topk(2, dim=-1)
            hits = (top.indices[:, 0] == torch.tensor(g)).tolist()
            agree += sum(hits)
            total += len(hits)
            first = next((i for i, h in enumerate(hits) if not h), None)
            parts.append({"first_disagreement": first, "length": len(g),
                          "margin_there": None if first is None else float(top.values[first, 0] - top.values[first, 1]),
                          "trainer_margin_median": float(torch.median(top.values[:, 0] - top.values[:, 1]))})
    alignment.remove()
    return {"run": str(run), "checkpoint": checkpoint, "regions": regions, "mode": "eager" if cfg.vllm_enforce_eager
            else "compiled", "prompts": len(rows), "greedy_reward": float(sum(rewards) / len(rewards)),
            "greedy_accuracy": float(sum(task.correct(t, r["answer"], i, prompt=r["prompt"])
                                         for t, r, i in zip(texts, rows, greedy)) / len(rows)),
            "mean_length": sum(map(len, greedy)) / len(greedy),
            "trainer_argmax_agrees": agree / total if total else None,
            "prompts_fully_agreeing": sum(p["first_disagreement"] is None for p in parts),
            "per_prompt": parts, "first_texts": texts[:3]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--regions", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    from rpa.core.jsonfiles import write_json

    result = greedy_probe(args.run, args.checkpoint, args.regions)
    write_json(args.out, result)
    print(f"greedy_probe: {args.regions}: greedy reward {result['greedy_reward']:.3f}, trainer argmax agrees "
          f"{result['trainer_argmax_agrees']:.4f} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
