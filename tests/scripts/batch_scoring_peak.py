"""Peak resident memory of the probe's batch scoring (trainer_batch_logprobs) on a tiny model
with Qwen3's 151,936-token vocabulary and 256 completions: prints JSON {"peak_mb", "base_mb"}."""

import json
import resource
import sys

import torch

from rpa.measure.scoring import trainer_batch_logprobs
from rpa.sides.tiny import TinySpec, build_tiny


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


out = sys.argv[1]
path = build_tiny(out, TinySpec(arch="qwen3", vocab_size=151936, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32))
from transformers import AutoModelForCausalLM  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
g = torch.Generator().manual_seed(0)
comps = [{"prompt_ids": torch.randint(3, 151936, (8,), generator=g).tolist(),
          "completion_ids": torch.randint(3, 151936, (40,), generator=g).tolist()} for _ in range(256)]
base = rss_mb()
logps = trainer_batch_logprobs(model, comps, pad_id=0)
assert len(logps) == 256 and all(len(x) == 40 for x in logps)
print(json.dumps({"peak_mb": rss_mb(), "base_mb": base}))
