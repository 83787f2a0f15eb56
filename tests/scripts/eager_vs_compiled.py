"""Sample with an eager and a compiled vLLM engine under one region set; write both."""

import json
import sys

from vllm import SamplingParams

from rpa.core.numerics_config import NumericsConfig
from rpa.sides.engine import make_llm

PROMPTS = ["What is 12 + 7? Answer:", "sort 3 1 2 ->", "the number of", "count up: 1 2 3"]


def sample(model: str, numerics: NumericsConfig, compiled: bool) -> list[dict]:
    llm = make_llm(model, numerics, enforce_eager=not compiled, seed=0)
    params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=1234)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outs]


if __name__ == "__main__":
    model, regions, mode, out = sys.argv[1:5]
    with open(out, "w") as f:
        json.dump(sample(model, NumericsConfig.from_dict({"regions": regions}), compiled=(mode == "compiled")), f)
