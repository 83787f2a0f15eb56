"""The trainer-side scoring of the GRPO runner: micro-batches and a chunked log-softmax keep
memory far below the full ``tokens x vocabulary`` FP32 tensor, with the same values."""

import json

import torch

from tests.conftest import run_py, tail

SCRIPT = """
import json, resource, sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from rpa.measure.scoring import token_logps_and_entropy
from rpa.core.numerics_config import NumericsConfig
from rpa.sides.trainer import align_model
torch.manual_seed(0)
config = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
model = Qwen3ForCausalLM(config).eval()
align_model(model, NumericsConfig.from_dict({"regions": "all"}))
ids = torch.randint(3, 151936, (16, 320))
mask = torch.ones_like(ids)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
runs = {}
for chunk in map(int, sys.argv[1:]):  # smallest first: the high-water mark can only rise
    with torch.no_grad():
        logps, ent = token_logps_and_entropy(model, ids, mask, 256, batch_size=4, compute_entropy=True,
                                             chunk_tokens=chunk)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    runs[chunk] = {"peak_mb": peak / 1024, "sum": float(logps.double().sum()), "ent": float(ent.double().sum())}
    del logps, ent
print(json.dumps(runs))
"""


def test_scoring_memory_is_bounded_by_the_chunk(tmp_path):
    full_mb = 16 * 256 * 151936 * 4 / 2**20  # the FP32 log-probabilities of every scored token: 2374 MB
    # 128 tokens: 74 MB of logits per chunk; 1024 (one micro-batch): 594 MB. One process, the smaller chunk
    # first: its peak over the loaded model, then the larger one's (the process's high-water mark rises to it)
    proc = run_py(["-c", SCRIPT, "128", "1024"], timeout=600)
    assert proc.returncode == 0, tail(proc)
    runs = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert runs[128]["peak_mb"] < full_mb / 4, runs  # measured: 344 MB (logits, log-softmax, entropy)
    assert runs[128]["peak_mb"] < runs[1024]["peak_mb"], runs  # control: the bound follows the chunk
    assert runs[128]["sum"] == runs[1024]["sum"] and runs[128]["ent"] == runs[1024]["ent"]


def test_chunked_training_scores_equal_the_plain_forward(tiny_dirs):
    """Log-probabilities equal the plain full-logits path bit for bit; gradients agree to
    the BF16 rounding of the LM-head weight gradient, which is summed per chunk."""
    from transformers import AutoModelForCausalLM

    from rpa.core.numerics_config import NumericsConfig
    from rpa.measure.scoring import token_logps_and_entropy
    from rpa.sides.trainer import align_model

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.float32)
    align_model(model, NumericsConfig.from_dict({"regions": "all"}))
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


def test_per_row_scoring_is_each_row_alone_without_its_padding(tiny_dirs):
    """``trainer_batching: per_row``: each row of a TRL-shaped batch (prompts padded on the left,
    completions on the right) scores as that row's tokens alone, bit for bit, with entropies and
    gradients; its padded positions are 0, and a row with nothing to score runs no forward."""
    from transformers import AutoModelForCausalLM

    from rpa.measure.scoring import token_logps_and_entropy, token_logps_and_entropy_per_row

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.bfloat16, attn_implementation="eager")
    prompt, completion = 9, 7
    ids = torch.randint(3, 500, (4, prompt + completion), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    spans = [(0, 7), (3, 2), (5, 5), (2, 0)]  # (left padding of the prompt, completion tokens)
    for row, (left, kept) in enumerate(spans):
        mask[row, left:prompt + kept] = 1
    logps, ent = token_logps_and_entropy_per_row(model, ids, mask, completion, compute_entropy=True)
    assert logps.shape == ent.shape == (4, completion)
    for row, (left, kept) in enumerate(spans):
        assert not logps[row, kept:].any() and not ent[row, kept:].any()
        if kept:
            alone = ids[row:row + 1, left:prompt + kept]
            want, want_ent = token_logps_and_entropy(model, alone, torch.ones_like(alone), kept, compute_entropy=True)
            assert torch.equal(logps[row, :kept], want[0]) and torch.equal(ent[row, :kept], want_ent[0])
    logps.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    padded, _ = token_logps_and_entropy(model, ids, mask, completion)
    assert not torch.equal(padded[2, :5], logps[2, :5].detach())  # control: a padded row is another computation


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


def test_the_per_row_bits_benchmark_runs_and_finds_the_tiny_models_rows_equal(tiny_dirs):
    """``benchmarks/per_row_bits.py`` (SmolLM2's numbers are in docs/training.md): on the tiny Llama,
    every sampled token's logprob is the per-row training forward's, bit for bit."""
    proc = run_py(["benchmarks/per_row_bits.py", "--model", str(tiny_dirs["llama"]), "--tokens", "4"], timeout=600)
    assert proc.returncode == 0, tail(proc)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["head_rows"] for r in rows] == [2, 1]
    assert all(r["tokens"] > 0 and r["bitwise_equal"] == r["tokens"] for r in rows), rows


def test_aligned_full_training_forward_of_a_sequence_does_not_depend_on_its_padding(tiny_dirs):
    """``aligned-full`` (issue 56): the three regions and the trainer's attention in FP32 on FP32 masters
    with BF16 compute, scored ``per_row``: a sequence's log-probs and entropies are the same bits whatever
    the batch around it and however much left padding its prompt gets. The control: the padded forward of
    the same batches with HF's stock positions (shifted by the left padding) does depend on it. (Whether
    the padded forward with positions from the mask depends on it is the CPU's sdpa kernel's business: on
    the AMD EPYC it does, ~0.02 of mismatch on SmolLM2; on the tiny model on a Xeon with AMX it did not.)"""
    from transformers import AutoModelForCausalLM

    from rpa.core.numerics_config import NumericsConfig
    from rpa.measure.scoring import token_logps_and_entropy, token_logps_and_entropy_per_row
    from rpa.sides.trainer import align_model

    config = NumericsConfig.from_dict({"regions": "all", "trainer_attention": "fp32", "trainer_positions": "mask"})
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.float32, attn_implementation="sdpa")
    align_model(model, config)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(3, 500, (6 + 5,), generator=gen)  # a 6-token prompt, 5 completion tokens
    completion = 8

    def batch(left: int, others: int):
        """The sequence as row 0, its prompt left-padded by ``left``, beside ``others`` random rows."""
        prompt_len = 6 + left
        rows = torch.randint(3, 500, (1 + others, prompt_len + completion), generator=gen)
        mask = torch.ones_like(rows)
        rows[0, left:prompt_len + 5] = seq
        mask[0, :left] = 0
        mask[0, prompt_len + 5:] = 0  # its completion is 5 of the 8 positions
        return rows, mask

    stock = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.float32, attn_implementation="sdpa")
    align_model(stock, NumericsConfig.from_dict({"regions": "all", "trainer_attention": "fp32",
                                                 "trainer_positions": "stock"}))
    got, padded = [], []
    for left, others in ((0, 1), (7, 3), (19, 2)):
        ids, mask = batch(left, others)
        logps, ent = token_logps_and_entropy_per_row(model, ids, mask, completion, compute_entropy=True)
        got.append((logps[0, :5].detach(), ent[0, :5].detach()))
        with torch.no_grad():
            padded.append(token_logps_and_entropy(stock, ids, mask, completion)[0][0, :5])
    for logps, ent in got[1:]:
        assert torch.equal(logps, got[0][0]) and torch.equal(ent, got[0][1])
    assert not any(torch.equal(p, padded[0]) for p in padded[1:])  # control: a forward that sees the padding


def test_scoring_with_the_samplers_truncation_renormalises_and_splits_as_the_pure_functions_do(tiny_dirs):
    """``trainer_logprobs: renormalised`` and the per-step split go through the training path's chunked head:
    the renormalised logprobs, the full recompute and the gap's truncation part equal the pure functions of
    rpa.core.sampling on the plain forward's logits bit for bit, padded or per row; gradients flow through the
    renormalised logprobs; without truncation the recompute column is the plain path's own."""
    from transformers import AutoModelForCausalLM

    from rpa.core.numerics_config import NumericsConfig
    from rpa.core.sampling import SamplingSettings, kept_support, renormalised_logprobs, transform_part
    from rpa.measure.scoring import Transforms, token_logps_and_entropy, token_logps_and_entropy_per_row
    from rpa.sides.trainer import align_model

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.float32)
    align_model(model, NumericsConfig.from_dict({"regions": "all"}))
    ids = torch.randint(3, 500, (4, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    settings = SamplingSettings(temperature=0.7, top_p=0.9, top_k=50)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, -13:-1].float().reshape(-1, model.config.vocab_size)
    targets = ids[:, -12:].reshape(-1)
    keep, outside = kept_support(logits, targets, settings)
    want = {"renormalised": renormalised_logprobs(logits, targets, settings, keep).view(4, 12),
            "recompute": torch.log_softmax(logits / 0.7, -1).gather(-1, targets[:, None]).view(4, 12),
            "part": transform_part(logits, targets, settings, keep).view(4, 12)}
    assert outside.any() and not outside.all()  # random tokens: some outside the kept set, some inside
    for per_row in (False, True):
        with torch.no_grad():
            if per_row:
                logps, _, extra = token_logps_and_entropy_per_row(model, ids, mask, 12, 0.7, chunk_tokens=7,
                                                                  transforms=Transforms(settings, True, True))
            else:
                logps, _, extra = token_logps_and_entropy(model, ids, mask, 12, 0.7, batch_size=2, chunk_tokens=7,
                                                          transforms=Transforms(settings, True, True))
        assert torch.equal(logps, want["renormalised"]), per_row
        assert torch.equal(extra[..., 0], want["recompute"]) and torch.equal(extra[..., 1], want["part"])
        assert torch.equal(extra[..., 2].bool(), outside.view(4, 12))
    model.zero_grad()
    logps, _ = token_logps_and_entropy(model, ids, mask, 12, 0.7, chunk_tokens=7,
                                       transforms=Transforms(settings, renormalise=True))
    logps.sum().backward()  # through the checkpointed head
    assert torch.equal(logps.detach(), want["renormalised"])
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        plain, _ = token_logps_and_entropy(model, ids, mask, 12, chunk_tokens=7)
        same, _, extra = token_logps_and_entropy(model, ids, mask, 12, chunk_tokens=7,
                                                 transforms=Transforms(SamplingSettings(), parts=True))
    assert torch.equal(same, plain) and torch.equal(extra[..., 0], plain) and not extra[..., 1:].any()
