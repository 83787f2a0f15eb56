"""Sample with an eager and a compiled vLLM engine under one region set, one after the other in this
process (the region set is fixed per process, the engines are not); write both."""

import json
import sys

from vllm import SamplingParams

from rpa.core.numerics_config import NumericsConfig
from rpa.sides import engine

PROMPTS = ["What is 12 + 7? Answer:", "sort 3 1 2 ->", "the number of", "count up: 1 2 3"]
MODES = ("eager", "compiled")


def sample(model: str, numerics: NumericsConfig, compiled: bool) -> list[dict]:
    llm = engine.make_llm(model, numerics, enforce_eager=not compiled, seed=0)
    params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=1234)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    engine.close_llm(llm)  # memory back before the next engine starts
    del llm
    engine.release_memory()
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outs]


if __name__ == "__main__":
    model, regions, out = sys.argv[1:4]
    numerics = NumericsConfig.from_dict({"regions": regions})
    with open(out, "w") as f:
        json.dump({mode: sample(model, numerics, compiled=(mode == "compiled")) for mode in MODES}, f)
