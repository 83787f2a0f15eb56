"""The trainer-side scoring of the GRPO runner: micro-batches and a chunked log-softmax keep
memory far below the full ``tokens x vocabulary`` FP32 tensor, with the same values."""

import json

import torch

from tests.conftest import run_py, tail

SCRIPT = """
import json, resource, sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from rpa.measure.scoring import token_logps_and_entropy
from rpa.sides.trainer import align_model
torch.manual_seed(0)
config = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
model = Qwen3ForCausalLM(config).eval()
align_model(model, "all")
ids = torch.randint(3, 151936, (16, 320))
mask = torch.ones_like(ids)
chunk = int(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    logps, ent = token_logps_and_entropy(model, ids, mask, 256, batch_size=4, compute_entropy=True,
                                         chunk_tokens=chunk)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"peak_mb": peak / 1024, "sum": float(logps.double().sum()), "ent": float(ent.double().sum())}))
"""


def test_scoring_memory_is_bounded_by_the_chunk(tmp_path):
    full_mb = 16 * 256 * 151936 * 4 / 2**20  # the FP32 log-probabilities of every scored token: 2374 MB
    runs = {}
    for chunk in (128, 1024):  # 128 tokens: 74 MB of logits per chunk; 1024 (one micro-batch): 594 MB
        proc = run_py(["-c", SCRIPT, str(chunk)], timeout=600)
        assert proc.returncode == 0, tail(proc)
        runs[chunk] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs[128]["peak_mb"] < full_mb / 4, runs  # measured: 344 MB (logits, log-softmax, entropy)
    assert runs[128]["peak_mb"] < runs[1024]["peak_mb"], runs  # control: the bound follows the chunk
    assert runs[128]["sum"] == runs[1024]["sum"] and runs[128]["ent"] == runs[1024]["ent"]


def test_chunked_training_scores_equal_the_plain_forward(tiny_dirs):
    """Log-probabilities equal the plain full-logits path bit for bit; gradients agree to
    the BF16 rounding of the LM-head weight gradient, which is summed per chunk."""
    from transformers import AutoModelForCausalLM

    from rpa.measure.scoring import token_logps_and_entropy
    from rpa.sides.trainer import align_model

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.float32)
    align_model(model, "all")
    ids = torch.randint(3, 500, (4, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    grads = []
    for chunk in (7, 4 * 12):
        model.zero_grad()
        logps, _ = token_logps_and_entropy(model, ids, mask, 12, batch_size=2, chunk_tokens=chunk)
        logps.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        plain = torch.log_softmax(model(ids, attention_mask=mask).logits[:, -13:-1].float(), -1)
        assert torch.equal(logps.detach(), plain.gather(-1, ids[:, -12:, None])[..., 0].detach())
    for a, b in zip(*grads):
        assert ((a - b).norm() / b.norm()) < 1e-2


def test_probe_batch_scoring_memory_is_bounded_at_qwen3_vocabulary(tmp_path):
    """256 completions at Qwen3's 151,936-token vocabulary: the probe's padded-batch scoring goes
    through the chunked training path, so its peak stays near one chunk of logits; the whole
    batch's FP32 logits alone would be 256 x 40 x 151,936 x 4 bytes = 6.2 GB."""
    import json

    from tests.conftest import run_py, tail

    proc = run_py(["tests/scripts/batch_scoring_peak.py", str(tmp_path / "bigvocab")], timeout=600)
    assert proc.returncode == 0, tail(proc)
    peak = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = peak["peak_mb"] - peak["base_mb"]
    print(f"batch scoring peak: +{grew:.0f} MB over the loaded model")
    assert grew < 2500, peak
