"""Whether recompute sampling of each prompt alone gives the logprobs the training forward gives the
same tokens, bit for bit (``trainer_batching: per_row``, ``trainer_decode: recompute``,
``attn_implementation: eager``). Prints JSON; asserts nothing.

    python benchmarks/per_row_bits.py --model results/collapse-smollm2/models/smollm2 --tokens 48

Each prompt is sampled alone (no cache, at temperature 1, the LM head on the last ``--head-rows``
positions: 2 as the runner does, 1 to see a one-row matmul), the sampled tokens' decode-time
logprobs kept (FP32 log-softmax of the raw logits, as the runner keeps them); the sequences are then
laid out as TRL's training batch (prompts padded on the left, completions on the right) and scored
per row (:func:`rpa.measure.scoring.token_logps_and_entropy_per_row`). Per head size: the tokens,
how many logprobs are bitwise equal, their mean |difference|, the seconds taken.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = ("12+7=19. 31+45=76. 8+60=68. 27+38=", "What is 5 plus 17?", "Add: 44+19 =", "3+4=7, 11+2=13, 40+40=")


def sample_alone(model, tokenizer, prompt: str, tokens: int, head_rows: int) -> tuple[list[int], list[int], list[float]]:
    """One prompt sampled alone without a cache: its ids, the sampled ids, their decode-time logprobs."""
    import torch

    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=tokens, output_logits=True,
                             return_dict_in_generate=True, use_cache=False, logits_to_keep=head_rows,
                             pad_token_id=tokenizer.eos_token_id)
    new = out.sequences[0, ids.size(1):].tolist()
    logps = [float(torch.log_softmax(out.logits[s][0].float(), -1)[t]) for s, t in enumerate(new)]
    return ids[0].tolist(), new, logps


def compare(model, tokenizer, tokens: int, head_rows: int) -> dict:
    import torch

    from rpa.measure.scoring import token_logps_and_entropy_per_row, trl_batch

    start = time.time()
    rows = [sample_alone(model, tokenizer, p, tokens, head_rows) for p in PROMPTS]
    ids, mask, width_c = trl_batch([{"prompt_ids": p, "completion_ids": c} for p, c, _ in rows],
                                   tokenizer.eos_token_id)
    with torch.no_grad():
        pi, _ = token_logps_and_entropy_per_row(model, ids, mask, width_c)
    pairs = [(float(pi[r, j]), mu) for r, (_, _, logps) in enumerate(rows) for j, mu in enumerate(logps)]
    return {"tokens": len(pairs), "bitwise_equal": sum(a == b for a, b in pairs),
            "mean_abs_dlogp": sum(abs(a - b) for a, b in pairs) / len(pairs), "seconds": round(time.time() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local checkpoint directory")
    parser.add_argument("--tokens", type=int, default=48, help="tokens sampled per prompt")
    parser.add_argument("--head-rows", default="2,1", help="LM-head rows per sampling step, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="eager").eval()
    for rows in (int(r) for r in args.head_rows.split(",")):
        print(json.dumps({"model": args.model, "head_rows": rows, **compare(model, tokenizer, args.tokens, rows)}),
              flush=True)


if __name__ == "__main__":
    main()
