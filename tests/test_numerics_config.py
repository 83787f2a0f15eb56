"""Numerics configurations: validation, both sides' settings, the FP32 LM head, TRL batch layout."""

import pytest
import torch
import torch.nn.functional as F

from rpa.cli import main as cli_main
from rpa.core.numerics_config import NumericsConfig, NumericsConfigError
from rpa.measure.scoring import trainer_batch_logprobs, trainer_logprobs
from rpa.sides.trainer import load_trainer_model, trainer_context


def test_defaults_are_the_study_baseline():
    n = NumericsConfig.from_dict({})
    assert n.to_dict() == {"regions": "none", "precision": "bf16", "lm_head_fp32": False, "trainer_mode": "compute",
                         "device": "auto", "sampler_perturbation": None,
                         "trainer_positions": "auto", "aligned_sides": "both",
                         "trainer_attention": "stock"}  # the dose is off unless asked for
    # trainer_precision is written only where it is not the default: every existing configuration writes what it did
    assert "trainer_precision" not in n.to_dict() and n.trainer_precision == "same"
    fp32_trainer = NumericsConfig.from_dict({"trainer_precision": "fp32"}).to_dict()
    assert list(fp32_trainer) == [*n.to_dict(), "trainer_precision"] and fp32_trainer["trainer_precision"] == "fp32"
    assert n.vllm_kwargs() == {"dtype": "bfloat16"}
    assert (n.trainer_precision_name, n.trainer_dtype_name, n.trainer_torch_dtype()) == ("bf16", "bfloat16",
                                                                                         torch.bfloat16)
    assert NumericsConfig.from_dict({"regions": "rope,swiglu"}).to_dict()["regions"] == "rope,swiglu"


@pytest.mark.parametrize("entry,message", [
    ({"regions": "all", "precision": "fp32"}, "no BF16 rounding to align"),
    ({"precision": "fp32", "lm_head_fp32": True}, "redundant"),
    ({"precision": "fp32", "trainer_mode": "autocast"}, "16-bit precision"),
    ({"regions": "rope", "precision": "fp16"}, "BF16 contract"),
    ({"regions": "rope,attention"}, "unknown region(s) 'attention'"),
    ({"precision": "bf17"}, "precision: 'bf17' is not one of bf16, fp16, fp32"),
    ({"trainer_mode": "fsdp"}, "trainer_mode: 'fsdp' is not one of compute, autocast"),
    ({"regions": "all", "lmhead": True}, "unknown key(s) lmhead"),
    ({"lm_head_fp32": "yes"}, "true or false"),
])
def test_invalid_combinations_are_refused(entry, message):
    with pytest.raises(NumericsConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NumericsConfig.from_dict(entry)


FP32_TRAINER_REFUSALS = [
    ({"precision": "fp32"}, "trainer_precision fp32 is redundant with precision fp32 (both sides are FP32 already); "
                            "use trainer_precision: same"),
    ({"regions": "all"}, "trainer_precision fp32 leaves no BF16 rounding on the trainer to align; use regions: none "
                         "(the regions align the BF16 rounding of both sides)"),
    ({"regions": "rope", "aligned_sides": "sampler"}, "trainer_precision fp32 leaves no BF16 rounding on the trainer "
                                                      "to align"),
    ({"trainer_mode": "autocast"}, "trainer_mode autocast computes in the precision; trainer_precision fp32 computes "
                                   "in FP32 (use trainer_mode: compute)"),
    ({"trainer_attention": "fp32"}, "trainer_attention fp32 is redundant with trainer_precision fp32 (the trainer's "
                                    "attention is FP32 already)"),
    ({"sampler_perturbation": {"mantissa_bits": 4}}, "sampler_perturbation doses the BF16 sampler of a BF16 trainer "
                                                     "(the positive control); with trainer_precision fp32 the dose "
                                                     "would ride on the FP32-trainer gap: use trainer_precision: same"),
    ({"trainer_precision": "fp64"}, "trainer_precision: 'fp64' is not one of same, fp32"),
]


@pytest.mark.parametrize("entry,message", FP32_TRAINER_REFUSALS)
def test_an_fp32_trainer_refuses_each_combination_without_meaning_in_one_line(entry, message):
    with pytest.raises(NumericsConfigError) as err:
        NumericsConfig.from_dict({"trainer_precision": "fp32", **entry})
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_an_fp32_trainer_keeps_the_samplers_precision_and_round_trips():
    """``trainer_precision: fp32``: the trainer's dtype is FP32, vLLM's stays the precision (BF16, or FP16),
    the FP32 LM head reaches the sampler (the trainer's head is FP32 anyway); to_dict/from_dict round trip."""
    n = NumericsConfig.from_dict({"trainer_precision": "fp32"})
    assert (n.trainer_precision_name, n.trainer_dtype_name, n.trainer_torch_dtype()) == ("fp32", "float32",
                                                                                         torch.float32)
    assert (n.dtype_name, n.torch_dtype()) == ("bfloat16", torch.bfloat16) and n.vllm_kwargs() == {"dtype": "bfloat16"}
    assert NumericsConfig.from_dict({"trainer_precision": "fp32", "precision": "fp16"}).vllm_kwargs() == {
        "dtype": "float16"}
    head = NumericsConfig.from_dict({"trainer_precision": "fp32", "lm_head_fp32": True})
    assert head.vllm_kwargs() == {"dtype": "bfloat16", "hf_overrides": {"head_dtype": "float32"}}
    for entry in ({"trainer_precision": "fp32"}, {"trainer_precision": "fp32", "trainer_positions": "mask"},
                  {"trainer_precision": "fp32", "precision": "fp16", "lm_head_fp32": True}, {"regions": "all"}):
        config = NumericsConfig.from_dict(entry)
        assert NumericsConfig.from_dict(config.to_dict()) == config
        assert config.to_dict().get("trainer_precision", "same") == entry.get("trainer_precision", "same")
    assert n.sampler_process_key == NumericsConfig().sampler_process_key  # one engine serves both
    assert n != NumericsConfig()


def test_the_cli_takes_trainer_precision_and_refuses_its_meaningless_combinations_in_one_line(capsys, tmp_path):
    """``--trainer-precision`` reaches the configuration; a combination without meaning is one line, before
    anything loads; ``rpa attribute`` (vLLM's BF16 kernels swapped into a BF16 trainer) refuses an FP32 trainer."""
    from rpa.cli import _numerics, build_parser
    from tests.conftest import refused

    args = build_parser().parse_args(["probe", "--model", "m", "--regions", "none", "--out", "o",
                                      "--trainer-precision", "fp32"])
    assert _numerics(args) == NumericsConfig.from_dict({"trainer_precision": "fp32"})
    out = tmp_path / "out"
    refused(capsys, ["probe", "--model", tmp_path / "no-such-model", "--regions", "all", "--trainer-precision", "fp32",
                     "--out", out], "trainer_precision fp32 leaves no BF16 rounding on the trainer to align",
            absent=out)
    refused(capsys, ["attribute", "--model", tmp_path / "no-such-model", "--regions", "none", "--trainer-precision",
                     "fp32", "--completions", tmp_path / "c.jsonl", "--out", out], "--trainer-precision must be same",
            absent=out)


def test_comparison_points_reach_vllm():
    assert NumericsConfig.from_dict({"lm_head_fp32": True}).vllm_kwargs() == {
        "dtype": "bfloat16", "hf_overrides": {"head_dtype": "float32"}}
    assert NumericsConfig.from_dict({"precision": "fp16"}).vllm_kwargs() == {"dtype": "float16"}


def test_cli_refuses_invalid_combination_before_loading(capsys, tmp_path):
    rc = cli_main(["probe", "--model", str(tmp_path / "no-such-model"), "--regions", "all", "--precision", "fp32",
                   "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "no BF16 rounding to align" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode", ["compute", "autocast"])
def test_fp32_lm_head_is_fp32_linear_of_the_hidden_state(tiny_dirs, mode):
    numerics = NumericsConfig.from_dict({"regions": "all", "lm_head_fp32": True, "trainer_mode": mode})
    model, handle = load_trainer_model(numerics, str(tiny_dirs["qwen3"]))
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with trainer_context(numerics), torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    assert out.logits.dtype == torch.float32 and handle.describe()["lm_head_fp32"]
    assert torch.equal(out.logits, F.linear(hidden.float(), model.lm_head.weight.float()))
    handle.remove()
    with trainer_context(numerics), torch.no_grad():  # control: the stock head runs in BF16
        plain = model.lm_head(hidden)
    assert plain.dtype == torch.bfloat16 and not torch.equal(plain.float(), out.logits)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_an_fp32_trainer_is_the_fp32_trainer_bit_for_bit(tiny_dirs, arch):
    """``trainer_precision: fp32`` beside a BF16 sampler: the trainer's logits equal (``torch.equal``) those
    of ``precision: fp32`` -- and of the stock FP32 HF model -- on a left-padded batch, with FP32
    parameters; the BF16 trainer of the same model gives other logits (the control: a trainer left at the
    precision would fail the equality)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, as TRL lays a batch out
    mask[2, :7] = 0

    def logits(numerics):
        model, handle = load_trainer_model(numerics, str(tiny_dirs[arch]))
        with trainer_context(numerics), torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).logits
        record = handle.describe()
        handle.remove()
        return out, record, {p.dtype for p in model.parameters()}

    mine, record, dtypes = logits(NumericsConfig.from_dict({"trainer_precision": "fp32"}))
    floor, _, _ = logits(NumericsConfig.from_dict({"precision": "fp32"}))
    bf16, _, _ = logits(NumericsConfig.from_dict({}))
    stock = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        plain = stock(input_ids=ids, attention_mask=mask).logits
    assert dtypes == {torch.float32} and record["compute_dtype"] == "float32" and record["regions"] == "none"
    assert mine.dtype == torch.float32 and torch.equal(mine, floor) and torch.equal(mine, plain)
    assert not torch.equal(mine, bf16) and (mine - bf16).abs().max() > 1e-4


def test_trl_batch_layout_with_rope_aligned_equals_batch_one(tiny_dirs):
    """Prompts left-padded + completions right-padded, no position_ids: with RoPE aligned
    (positions from the mask) and order-stable eager attention, the batch gives the
    batch-1 logprobs bit for bit; stock RoPE shifts positions by the pad count."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    comps = [{"prompt_ids": torch.randint(3, 500, (p,), generator=g).tolist(),
              "completion_ids": torch.randint(3, 500, (c,), generator=g).tolist()}
             for p, c in ((5, 9), (11, 3), (8, 6))]
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.bfloat16,
                                                 attn_implementation="eager")
    results = {}
    for regions in ("all", "none"):
        numerics = NumericsConfig.from_dict({"regions": regions})
        from rpa.sides.trainer import align_model

        with align_model(model, numerics):
            single = [trainer_logprobs(model, c["prompt_ids"], c["completion_ids"]) for c in comps]
            batch = trainer_batch_logprobs(model, comps, pad_id=0)
        results[regions] = (single, batch)
    assert results["all"][0] == results["all"][1]
    assert results["none"][0] != results["none"][1]


def test_grpo_token_logps_use_the_configured_lm_head(tiny_dirs):
    """The GRPO runner's trainer logprobs: FP32 masters in compute mode score exactly like the
    BF16 model (the LM head is not run on the FP32 masters, as TRL's fused head would), and
    equal the probe's per-sequence scoring bit for bit."""
    from transformers import AutoModelForCausalLM

    from rpa.measure.scoring import token_logps_and_entropy
    from rpa.sides.trainer import align_model

    path = str(tiny_dirs["qwen3"])
    ids = torch.randint(3, 500, (1, 14), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    master = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    aligned = NumericsConfig.from_dict({"regions": "all"})
    with align_model(master, aligned), align_model(bf16, aligned), torch.no_grad():
        a, ent = token_logps_and_entropy(master, ids, mask, 6, compute_entropy=True)
        b, _ = token_logps_and_entropy(bf16, ids, mask, 6)
        probe = trainer_logprobs(bf16, ids[0, :8].tolist(), ids[0, 8:].tolist())
        # control: TRL's fused head, i.e. the same BF16 hidden states through the FP32 master weight
        hidden = master.model(ids).last_hidden_state
        fused = torch.log_softmax(F.linear(hidden.float(), master.lm_head.weight), -1)
    assert torch.equal(a, b) and a[0].tolist() == probe
    assert ent.shape == (1, 6) and (ent > 0).all()
    assert hidden.dtype == torch.bfloat16
    assert not torch.equal(fused[0, 7:13].gather(-1, ids[0, 8:, None])[:, 0], a[0])


@pytest.mark.parametrize("spec,bits", [(None, None), ("", None), (" none ", None), ("mantissa_bits=4", 4),
                                       ("mantissa_bits = 1", 1), ("mantissa_bits=6", 6)])
def test_the_plugins_perturbation_setting_parses(spec, bits):
    from rpa.sides.vllm_plugin import parse_perturbation

    assert parse_perturbation(spec) == bits


@pytest.mark.parametrize("spec", ["mantissa_bits=0", "mantissa_bits=7", "bits=3", "mantissa_bits=x", "mantissa_bits"])
def test_the_plugins_perturbation_setting_refuses_what_is_not_a_dose(spec):
    from rpa.sides.vllm_plugin import PERTURB_ENV, parse_perturbation

    with pytest.raises(ValueError, match=f"{PERTURB_ENV}=.*expected 'mantissa_bits=K' with K in 1..6"):
        parse_perturbation(spec)


def test_numerics_flags_are_the_dataclasss_fields():
    """Each plain numerics flag of rpa probe/diagnose takes its default and choices from the
    NumericsConfig field: the CLI with no numerics flag but --regions gives the dataclass default."""
    import dataclasses

    from rpa.cli import NUMERICS_FLAGS, _numerics, build_parser

    args = build_parser().parse_args(["probe", "--model", "m", "--regions", "all", "--out", "o"])
    assert _numerics(args) == NumericsConfig.from_dict({"regions": "all"})
    fields = {f.name: f for f in dataclasses.fields(NumericsConfig)}
    for name in NUMERICS_FLAGS:
        assert getattr(args, name) == fields[name].default and fields[name].metadata["help"], name
    with pytest.raises(SystemExit):  # argparse refuses a value outside the field's choices
        build_parser().parse_args(["probe", "--model", "m", "--regions", "all", "--out", "o", "--precision", "fp8"])


def test_compile_cache_keys_differ_by_region_set_and_dose():
    """vLLM's own compile-cache key misses the plugin's regions and dose: ours names both (a
    unit check of the key; the engine test shows the caches are really kept apart)."""
    from rpa.sides.engine import compile_cache_key

    def numerics(regions, bits):
        return NumericsConfig.from_dict({"regions": regions,
                                         "sampler_perturbation": None if bits is None else {"mantissa_bits": bits}})

    keys = {compile_cache_key(numerics(r, bits)) for r in ("none", "rope", "swiglu,rope") for bits in (None, 3, 4)}
    assert len(keys) == 9
    assert compile_cache_key(numerics("rope,swiglu", 3)).startswith("rpa-rope+swiglu-perturb-mantissa3-kernels-")
    # the sampler's set names the cache: a trainer-only arm shares the stock engine's graphs
    trainer_only = NumericsConfig.from_dict({"regions": "all", "aligned_sides": "trainer"})
    assert compile_cache_key(trainer_only) == compile_cache_key(numerics("none", None))


def test_region_roots_share_one_model_info_cache(tmp_path):
    """Each region set's root links vLLM's model-info folder to one under the base (relative, so the cache
    folder can move); linking again changes nothing, and a root with a folder of its own keeps it (the engine
    test in test_vllm_compiled.py shows vLLM writing through the link)."""
    from rpa.sides.engine import share_model_info_cache

    base = tmp_path / "cache"
    for key in ("rpa-none-kernels-reference", "rpa-all-kernels-reference", "rpa-none-kernels-reference"):
        share_model_info_cache(str(base / key), str(base))
    for key in ("rpa-none-kernels-reference", "rpa-all-kernels-reference"):
        link = base / key / "modelinfos"
        assert link.is_symlink() and str(link.readlink()) == "../modelinfos" and link.resolve() == base / "modelinfos"
    (base / "rpa-rope-kernels-reference" / "modelinfos").mkdir(parents=True)
    share_model_info_cache(str(base / "rpa-rope-kernels-reference"), str(base))
    assert not (base / "rpa-rope-kernels-reference" / "modelinfos").is_symlink()
    moved = tmp_path / "moved"
    base.rename(moved)
    assert (moved / "rpa-all-kernels-reference" / "modelinfos").resolve() == moved / "modelinfos"
    # a link that leads nowhere (here: an absolute one into a folder since removed) is made again
    stale = moved / "rpa-swiglu-kernels-reference" / "modelinfos"
    stale.parent.mkdir()
    stale.symlink_to(tmp_path / "gone" / "modelinfos")
    share_model_info_cache(str(stale.parent), str(moved))
    assert stale.is_symlink() and stale.resolve() == moved / "modelinfos"


def test_a_region_set_reaches_the_sides_only_inside_a_numerics_config(tiny_dirs):
    """Past the CLI / config boundary the region set is a NumericsConfig: the sides' entry points
    refuse its text or a bare set (once they parsed it themselves, each its own way), and the
    configuration refuses text where its frozenset belongs (``"rope" in "all"`` is False)."""
    from transformers import AutoModelForCausalLM

    from rpa.measure.parity import run_parity
    from rpa.sides.engine import compile_cache_key, make_llm, make_llm_env, verify_plugin
    from rpa.sides.trainer import align_model

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.bfloat16)
    for loose in ("all", frozenset({"rope"})):
        for call in (lambda: make_llm(str(tiny_dirs["qwen3"]), loose), lambda: make_llm_env(loose),
                     lambda: verify_plugin(None, loose), lambda: compile_cache_key(loose),
                     lambda: align_model(model, loose), lambda: run_parity(str(tiny_dirs["qwen3"]), loose)):
            with pytest.raises(TypeError, match=r"takes a NumericsConfig, got .*NumericsConfig.from_dict"):
                call()
    assert getattr(model, "_rpa_alignment", None) is None
    for bad in ("all", {"rope"}, frozenset({"rope", "attention"})):
        with pytest.raises(NumericsConfigError, match="region"):
            NumericsConfig(regions=bad)


def test_every_option_of_every_config_dataclass_has_its_help():
    """One help convention, ``metadata={"help": ...}`` on every field (TRL's ``GRPOConfig``): what
    ``--help``, a config's reader and the docs take a field's meaning from."""
    from dataclasses import fields

    from rpa.core.numerics_config import NumericsConfig
    from rpa.measure.attribution import AttributionOptions
    from rpa.measure.diagnose import DiagnoseOptions
    from rpa.measure.parity import ParityOptions
    from rpa.measure.probe import ProbeOptions
    from rpa.sides.convert import GgufSource
    from rpa.sides.tiny import TinySpec
    from rpa.train.collapse import CollapseThresholds
    from rpa.train.config import SyncCheck, TrainConfig, WarmStart
    from rpa.train.tasks import TaskSpec

    missing = [f"{cls.__name__}.{f.name}" for cls in (NumericsConfig, ProbeOptions, DiagnoseOptions, AttributionOptions,
                                                      ParityOptions, GgufSource, TinySpec, CollapseThresholds,
                                                      SyncCheck, WarmStart, TrainConfig, TaskSpec)
               for f in fields(cls) if not str(f.metadata.get("help", "")).strip()]
    assert not missing, missing


def test_an_enumerated_option_is_a_literal_checked_once_and_offered_as_choices():
    """``Literal[...]`` fields: the coercion refuses other values naming the key and the values, a
    dataclass built in code is held to them too, and the CLI offers them as choices."""
    import argparse
    from dataclasses import dataclass, field
    from typing import Literal

    from rpa.core.fieldtypes import FieldTypeError, add_arguments, check_choices, choices, coerce
    from rpa.train.config import ROLLOUTS, Rollouts, TrainConfig, TrainConfigError

    assert choices(Rollouts) == ROLLOUTS == ("vllm", "trainer")
    assert coerce("rollouts", "trainer", Rollouts) == "trainer"
    for bad in ("sglang", 1, None):
        with pytest.raises(FieldTypeError, match="rollouts: .* is not one of vllm, trainer"):
            coerce("rollouts", bad, Rollouts)
    with pytest.raises(TrainConfigError, match="old_logprobs: 'vllm' is not one of trainer, sampler"):
        TrainConfig(model="m", old_logprobs="vllm")  # built in code, not through the coercion

    @dataclass
    class Opts:
        mode: Literal["a", "b"] = field(default="a", metadata={"help": "h"})

    parser = argparse.ArgumentParser()
    add_arguments(parser, Opts)
    assert parser.parse_args(["--mode", "b"]).mode == "b"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])
    with pytest.raises(FieldTypeError):
        check_choices(Opts(mode="c"))
