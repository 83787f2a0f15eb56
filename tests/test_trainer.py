"""Trainer-side alignment on real HF Qwen2/Qwen3/Llama models loaded from local directories."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from rpa.core.numerics_config import NumericsConfig
from rpa.sides.trainer import UnsupportedModelError, align_model, positions_from_mask

REGION_SETS = ["none", "rope", "swiglu", "rmsnorm", "rope,swiglu", "all"]


def numerics_config(regions, **options):
    """The configuration a config's ``numerics: {regions: ..., **options}`` reads to."""
    return NumericsConfig.from_dict({"regions": regions, **options})


def load(path, dtype=torch.bfloat16):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@pytest.fixture(params=["qwen2", "qwen3", "llama"])
def arch(request):
    return request.param


def fp32_master_and_bf16_copy(path):
    m32 = load(path, torch.float32)
    with torch.no_grad():  # master weights that are not BF16 values
        for p in m32.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    m16 = load(path, torch.bfloat16)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m32.state_dict().items()})
    return m32, m16


@pytest.mark.parametrize("regions", REGION_SETS)
def test_fp32_master_gives_bf16_copy_logits_bitwise(tiny_dirs, arch, regions):
    m32, m16 = fp32_master_and_bf16_copy(tiny_dirs[arch])
    ids = torch.randint(3, 500, (3, 17), generator=torch.Generator().manual_seed(0))
    with align_model(m32, numerics_config(regions)), align_model(m16, numerics_config(regions)), torch.no_grad():
        a, b = m32(ids).logits, m16(ids).logits
    assert a.dtype == torch.float32 and b.dtype == torch.bfloat16  # logits in the parameter dtype
    assert torch.equal(a, b.float())  # BF16 compute; the upcast is exact


def test_fp32_master_without_patch_is_not_bf16_compute(tiny_dirs):
    """Control: stock FP32 master under autocast is a different numerics."""
    m32, m16 = fp32_master_and_bf16_copy(tiny_dirs["qwen3"])
    ids = torch.randint(3, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = m32(ids).logits
    with torch.no_grad():
        b = m16(ids).logits
    assert not torch.equal(a.to(torch.bfloat16), b)


def logprobs(model, ids, mask=None):
    with torch.no_grad():
        return torch.log_softmax(model(ids, attention_mask=mask).logits.float(), -1)


def test_positions_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_left_padding_does_not_shift_rope(tiny_dirs, arch):
    """Bitwise with HF's eager attention. (PyTorch's CPU ``sdpa`` kernel is itself not
    invariant to the number of masked keys, so with ``sdpa`` a padded row differs from the
    row alone even at equal positions -- an attention-kernel effect the method leaves alone.)"""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.bfloat16, attn_implementation="eager")
    pad = model.config.pad_token_id
    long_seq, short_seq = list(range(10, 22)), list(range(40, 45))
    n_pad = len(long_seq) - len(short_seq)
    batch = torch.tensor([long_seq, [pad] * n_pad + short_seq])
    mask = torch.tensor([[1] * len(long_seq), [0] * n_pad + [1] * len(short_seq)])
    with align_model(model, numerics_config("all")):
        padded = logprobs(model, batch, mask)
        alone = logprobs(model, torch.tensor([short_seq]))
        alone_long = logprobs(model, torch.tensor([long_seq]))
    assert torch.equal(padded[1, n_pad:], alone[0])
    assert torch.equal(padded[0], alone_long[0])
    # control: stock HF shifts positions by the pad count
    stock_padded, stock_alone = logprobs(model, batch, mask), logprobs(model, torch.tensor([short_seq]))
    assert not torch.equal(stock_padded[1, n_pad:], stock_alone[0])


def test_remove_restores_stock_forward(tiny_dirs, arch):
    model = load(tiny_dirs[arch])
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    stock = logprobs(model, ids)
    handle = align_model(model, numerics_config("all"))
    aligned = logprobs(model, ids)
    handle.remove()
    assert not handle.active
    assert torch.equal(logprobs(model, ids), stock)
    assert not torch.equal(aligned, stock)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not any(n.startswith("rpa") for n, _ in model.named_buffers())


def test_double_alignment_is_refused(tiny_dirs):
    model = load(tiny_dirs["qwen2"])
    with align_model(model, numerics_config("rope")):
        with pytest.raises(RuntimeError, match="already aligned"):
            align_model(model, numerics_config("all"))


def grads(model, ids, checkpointing=False):
    model.zero_grad()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_gradients_match_fp32_reference_and_survive_checkpointing(tiny_dirs, arch):
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(2))
    reference = grads(load(tiny_dirs[arch], torch.float32), ids)
    model = load(tiny_dirs[arch], torch.float32)  # FP32 master, BF16 compute
    with align_model(model, numerics_config("all")):
        aligned = grads(model, ids)
        checkpointed = grads(model, ids, checkpointing=True)
    for name, ref in reference.items():
        assert aligned[name].dtype == torch.float32
        rel = (aligned[name] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel < 0.05, f"{name}: relative grad error {rel:.3g}"
        # recomputation inside backward() runs the same aligned forward
        assert torch.equal(checkpointed[name], aligned[name]), name


def test_aligned_gradients_are_no_further_from_fp32_than_stock_bf16s(tiny_dirs, arch):
    """A sharper check than a tolerance: every aligned region keeps FP32 intermediates, so its
    gradients must be at least as close to the FP32 model's as stock BF16 compute's are (a
    biased backward in one region would show here). Measured on a 4-layer model: relative
    error 1.6% aligned, 2.0% stock."""
    ids = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(3))

    def flat(g):
        return torch.cat([v.flatten() for v in g.values()])

    reference = flat(grads(load(tiny_dirs[arch], torch.float32), ids))
    errors = {}
    for regions in ("none", "all"):
        model = load(tiny_dirs[arch], torch.float32)  # FP32 master, BF16 compute
        with align_model(model, numerics_config(regions)):
            errors[regions] = ((flat(grads(model, ids)) - reference).norm() / reference.norm()).item()
    assert 0 < errors["all"] <= errors["none"], errors


def test_unsupported_architecture_is_refused():
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(UnsupportedModelError, match="Qwen2/Qwen3/Llama.*mistral.*Supported: qwen2.*llama"):
        align_model(MistralForCausalLM(config), numerics_config("all"))


def test_a_sliced_llama_projection_is_refused(tiny_dirs):
    """HF's Llama with pretraining_tp > 1 computes every projection as slices (other GEMMs than vLLM's)."""
    model = load(tiny_dirs["llama"])
    model.config.pretraining_tp = 2
    with pytest.raises(UnsupportedModelError, match="pretraining_tp 2"):
        align_model(model, numerics_config("all"))


def test_unsupported_rope_scaling_is_refused(tiny_dirs):
    model = load(tiny_dirs["qwen2"])
    model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn'.*supported: default"):
        align_model(model, numerics_config("rope"))


def test_bad_region_name_is_refused():
    with pytest.raises(ValueError, match="unknown region"):
        numerics_config("rope,attention")  # read where the text comes in, before a model is touched


def test_both_sides_share_one_cpu_built_rope_table(tiny_dirs):
    """The table is built on the CPU whatever the default device (vLLM builds its layers under
    the GPU's), by one function on both sides: the plugin's layer and the trainer hold the
    same bits. (On an H200: trainer table on cuda == plugin build, while building on CUDA
    would differ in ~19% of entries: results/reference/gpu/gpu_checks.json.)"""
    from rpa.core import numerics
    from rpa.sides.trainer import rope_table
    from rpa.sides.vllm_plugin import _make_layers

    with torch.device("meta"):  # a non-CPU default device: an unforced build would have no values
        table = numerics.rope_table(10000.0, 32, 1024)
    assert table.device.type == "cpu" and torch.equal(table, numerics.rope_table(10000.0, 32, 1024))
    model = load(tiny_dirs["qwen3"])
    with align_model(model, numerics_config("rope")):
        trainer = model.model.rotary_emb.rpa_cos_sin_bits.view(torch.float32)
        assert torch.equal(trainer, rope_table(model.config))
    from vllm.config import VllmConfig, set_current_vllm_config

    plugin_cls = _make_layers()["rope"][1]
    with set_current_vllm_config(VllmConfig()):
        layer = plugin_cls(head_size=32, rotary_dim=32, max_position_embeddings=model.config.max_position_embeddings,
                           base=model.config.rope_parameters["rope_theta"], is_neox_style=True, dtype=torch.bfloat16)
    assert torch.equal(layer.rpa_cos_sin, trainer)


def test_fp32_attention_rounds_once_and_leaves_with_the_patch(tiny_dirs, arch):
    """``trainer_attention: fp32``: HF's sdpa on the BF16 q/k/v upcast, rounded once (what vLLM's CPU
    attention kernel computes); FP32 masters still give their BF16 copy's logits bit for bit, gradients
    flow, and removing the alignment restores the stock attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rpa.sides.trainer import fp32_attention

    model = load(tiny_dirs[arch])
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 9, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    kv = lambda t: t[:, : model.config.num_key_value_heads]  # noqa: E731
    out, _ = fp32_attention(attn, q, kv(k), kv(v), None, scaling=attn.scaling)
    want, _ = sdpa_attention_forward(attn, q.float(), kv(k).float(), kv(v).float(), None, scaling=attn.scaling)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    stock, _ = sdpa_attention_forward(attn, q, kv(k), kv(v), None, scaling=attn.scaling)
    assert not torch.equal(out, stock)  # BF16 sdpa rounds its intermediates: another function
    m32, m16 = fp32_master_and_bf16_copy(tiny_dirs[arch])
    ids = torch.randint(3, 500, (2, 13), generator=g)
    before = m16.config._attn_implementation
    attention_fp32 = numerics_config("all", trainer_attention="fp32")
    with align_model(m32, attention_fp32) as a32, align_model(m16, attention_fp32):
        assert a32.describe()["attention"] == "fp32"
        with torch.no_grad():
            assert torch.equal(m32(ids).logits, m16(ids).logits.float())
        m32.train()
        m32(ids).logits.float().sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m32.parameters() if p.requires_grad)
    assert m16.config._attn_implementation == before


def test_fp32_attention_masks_the_padding(tiny_dirs, arch):
    """In a left-padded batch the pads are masked: what the pad positions hold cannot change a real
    token's logits (bitwise). Registering the attention without its mask builder made transformers
    build no mask at all, and the padding was attended."""
    model = load(tiny_dirs[arch])
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 500, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    other = ids.clone()
    other[0, :5] = torch.randint(3, 500, (5,), generator=g)  # other pad contents
    with align_model(model, numerics_config("all", trainer_attention="fp32")), torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = model(other, attention_mask=mask).logits
    assert torch.equal(a[0, 5:], b[0, 5:]) and torch.equal(a[1], b[1])
