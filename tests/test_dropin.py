"""``align_model`` as a drop-in on a user's own model: each path that broke at cd5027a
(issue 12), in both compute modes -- BF16 compute on FP32 masters (the default) and
``trainer_mode: autocast`` (TRL's autocast numerics) -- plus TRL's reference-model helper."""

import copy
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

from rpa.core.numerics_config import NumericsConfig
from rpa.sides.trainer import UnsupportedModelError, align_model

MODES = {"bf16-compute": dict(dtype=torch.float32, trainer_mode="compute"),
         "compute-none": dict(dtype=torch.bfloat16, trainer_mode="autocast")}


def numerics_config(regions="all", **options):
    """The configuration a config's ``numerics: {regions: ..., **options}`` reads to."""
    return NumericsConfig.from_dict({"regions": regions, **options})


@pytest.fixture(params=list(MODES))
def mode(request):
    return request.param


@pytest.fixture(params=["qwen2", "qwen3"])
def arch(request):
    return request.param


def aligned(path, mode, regions="all"):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=MODES[mode]["dtype"]).eval()
    align_model(model, numerics_config(regions, trainer_mode=MODES[mode]["trainer_mode"]))
    return model


def batch():
    ids = torch.randint(3, 500, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def test_deepcopy_is_an_independent_aligned_model(tiny_dirs, arch, mode):
    model = aligned(tiny_dirs[arch], mode)
    ids, mask = batch()
    before = logits(model, ids, mask)
    twin = copy.deepcopy(model)
    assert twin._rpa_alignment.model is twin and twin._rpa_alignment.active
    assert torch.equal(logits(twin, ids, mask), before)
    with torch.no_grad():  # train the original only
        for p in model.parameters():
            p.mul_(1.5)
    assert not torch.equal(logits(model, ids, mask), before)
    assert torch.equal(logits(twin, ids, mask), before)  # the copy runs its own weights
    twin._rpa_alignment.remove()  # and its own patch: removing it leaves the original aligned
    assert model._rpa_alignment.active and not any("forward" in m.__dict__ for m in twin.modules())


def test_trl_create_reference_model_is_frozen_and_aligned(tiny_dirs):
    from trl.models.utils import create_reference_model

    model = aligned(tiny_dirs["qwen3"], "bf16-compute")
    ids, mask = batch()
    ref = create_reference_model(model)
    assert torch.equal(logits(ref, ids, mask), logits(model, ids, mask))
    assert not any(p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(logits(ref, ids, mask), logits(model, ids, mask))


def test_pickle_and_torch_save_round_trip(tiny_dirs, arch, mode, tmp_path):
    model = aligned(tiny_dirs[arch], mode)
    ids, mask = batch()
    want = logits(model, ids, mask)
    assert torch.equal(logits(pickle.loads(pickle.dumps(model)), ids, mask), want)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded._rpa_alignment.describe()["regions"] == "all"
    assert torch.equal(logits(loaded, ids, mask), want)


def test_resize_token_embeddings_after_aligning(tiny_dirs, arch, mode):
    model = aligned(tiny_dirs[arch], mode)
    ids, mask = batch()
    old_vocab = model.config.vocab_size
    model.resize_token_embeddings(old_vocab + 8, mean_resizing=False)
    out = logits(model, ids, mask)  # crashed with "expected m1 and m2 to have the same dtype"
    assert out.shape[-1] == old_vocab + 8 and torch.isfinite(out).all()
    if MODES[mode]["trainer_mode"] == "compute":  # the new head and embedding compute in BF16 too
        assert model.get_output_embeddings()._rpa_patched and model.get_input_embeddings()._rpa_patched
        bf16 = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.bfloat16).eval()
        bf16.resize_token_embeddings(old_vocab + 8, mean_resizing=False)
        bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
        align_model(bf16, numerics_config("all"))
        assert torch.equal(out, logits(bf16, ids, mask).float())


def test_logits_in_the_parameter_dtype_and_dtype_changes(tiny_dirs):
    model = aligned(tiny_dirs["qwen3"], "bf16-compute")
    ids, mask = batch()
    out = logits(model, ids, mask)
    assert out.dtype == torch.float32
    out.numpy()  # what broke with BF16 logits
    model.to(torch.bfloat16)  # followed: same numerics, BF16 logits
    assert torch.equal(logits(model, ids, mask).float(), out)
    model.half()
    with pytest.raises(UnsupportedModelError, match="now torch.float16.*remove"):
        logits(model, ids, mask)


@pytest.mark.engine  # Inductor compiles C++ through gcc
def test_export_and_fullgraph_compile_without_host_sync(tiny_dirs, mode):
    """``int(position_ids.max())`` made both fail ("data-dependent expression"); the bound is
    now a device-side assert, so nothing in the forward reads a value back to the host."""
    model = aligned(tiny_dirs["qwen3"], mode)
    ids, mask = batch()
    want = logits(model, ids, mask)
    exported = torch.export.export(model, (ids,), {"attention_mask": mask, "use_cache": False})
    with torch.no_grad():
        assert torch.equal(exported.module()(ids, attention_mask=mask, use_cache=False).logits, want)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(ids, attention_mask=mask).logits, want)


def test_position_past_the_table_is_refused(tiny_dirs):
    model = aligned(tiny_dirs["qwen3"], "bf16-compute")
    too_far = torch.tensor([[model.config.max_position_embeddings]])
    with pytest.raises(RuntimeError, match="past max_position_embeddings"), torch.no_grad():
        model(torch.tensor([[5]]), position_ids=too_far)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("cls_name", ["Model", "ForSequenceClassification", "ForTokenClassification",
                                      "ForQuestionAnswering"])
def test_every_supported_class_aligns(tiny_dirs, arch, cls_name):
    """Base models and the classification / QA heads have no LM head (get_output_embeddings() is
    None): they align too, and with ``all`` FP32 masters in BF16 compute give their BF16 copy's
    outputs bit for bit."""
    import transformers
    from transformers import AutoConfig

    from rpa.sides.trainer import ARCHITECTURES, UnsupportedModelError, align_model

    config = AutoConfig.from_pretrained(tiny_dirs[arch])
    config.num_labels, config.pad_token_id = 3, 0
    cls = getattr(transformers, f"{ARCHITECTURES[arch].prefix}{cls_name}")
    torch.manual_seed(0)
    master = cls(config).float().eval()
    copy = cls(config).to(torch.bfloat16).eval()
    copy.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.state_dict().items()})
    ids = torch.randint(3, 500, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    outs = []
    for model in (master, copy):
        with align_model(model, numerics_config("all")), torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask)
        outs.append(next(v for v in (getattr(out, k, None) for k in ("logits", "start_logits", "last_hidden_state"))
                         if v is not None))
    assert torch.equal(outs[0].to(torch.bfloat16), outs[1].to(torch.bfloat16))
    with pytest.raises(UnsupportedModelError, match="has no LM head"):
        align_model(master, numerics_config("all", lm_head_fp32=True))


def test_the_rope_table_buffer_stays_out_of_checkpoints_and_leaves_with_the_patch(tiny_dirs, tmp_path):
    """What docs/known-behaviour.md says of ``rpa_cos_sin_bits``: listed by named_buffers(), absent from the
    state dict and a saved checkpoint, gone once the alignment is removed."""
    from safetensors import safe_open

    from rpa.sides.trainer import ROPE_TABLE_BUFFER

    model = aligned(tiny_dirs["qwen3"], "bf16-compute")
    buffers = [name for name, _ in model.named_buffers() if name.endswith(ROPE_TABLE_BUFFER)]
    assert buffers == [f"model.rotary_emb.{ROPE_TABLE_BUFFER}"]
    assert not any(k.endswith(ROPE_TABLE_BUFFER) for k in model.state_dict())
    model.save_pretrained(tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as f:
        assert not any(k.endswith(ROPE_TABLE_BUFFER) for k in f.keys())
    model._rpa_alignment.remove()
    assert not any(name.endswith(ROPE_TABLE_BUFFER) for name, _ in model.named_buffers())
