"""``rpa parity``: the fail-closed check that both sides run the same region numerics.

The same token batch goes through vLLM (with the plugin, capturing every aligned op's
inputs and outputs) and through the aligned HF model. Each captured vLLM call is replayed
through the trainer side (the aligned HF modules themselves where the region has weights,
the trainer's ``rpa::*`` ops otherwise) and compared bitwise. Captures need the ops'
Python bodies to run, which CUDA-graph replays skip: the replay engine never uses CUDA
graphs, and a compiled engine is checked as a whole by eager-vs-compiled logprob
equality. A region with no captured call fails. The report (schema ``rpa.parity/1``, see
docs/results.md) also carries the whole-model logprob gap, for information: matmul and attention
kernels are not aligned and keep it above zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rpa.core.fieldtypes import check_choices
from rpa.core.jsonfiles import write_json
from rpa.core.numerics_config import PRECISIONS, NumericsConfig
from rpa.core.regions import REGIONS, format_regions

if TYPE_CHECKING:  # torch loads with the check, not with the options (the CLI's parser imports this module)
    import torch
    from torch import Tensor

SCHEMA = "rpa.parity/1"
TrainerDtype = Literal["bf16", "fp32"]  # spelled as NumericsConfig.precision (rpa.core.numerics_config.PRECISIONS)


@dataclass(frozen=True)
class ParityOptions:
    """The parity check's options: the ``rpa parity`` flags and the ``parity:`` section of a
    pipeline config are built from these fields (:func:`rpa.core.fieldtypes.add_arguments`)."""

    compiled: bool = field(default=False, metadata={
        "help": "run vLLM compiled and check the compiled engine's logprobs against an eager one's (default: eager)"})
    multiprocess: bool = field(default=False, metadata={"help": "vLLM engine core in its own process"})
    trainer_dtype: TrainerDtype = field(default="bf16", metadata={
        "help": "parameter dtype of the HF model (fp32 = FP32 master, BF16 compute)"})

    def __post_init__(self) -> None:
        from rpa.core.errors import InputError

        check_choices(self, InputError)  # trainer_dtype (from a job file argparse's choices do not apply)


DEFAULT_PROMPTS = (
    "What is 12 + 7? Answer:",
    "sort 3 1 2 -> 1 2 3",
    "the number of words in this list is",
    "count up: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28",
)


class _Tally:
    def __init__(self) -> None:
        self.calls = 0
        self.checked = 0
        self.equal = 0
        self.max_abs_diff = 0.0
        self.first_mismatch: dict[str, Any] | None = None

    def add(self, what: str, got: Tensor, want: Tensor) -> None:
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{what}: trainer gives {tuple(got.shape)} {got.dtype}, "
                                 f"vLLM {tuple(want.shape)} {want.dtype}")
        same = got == want
        self.checked += same.numel()
        self.equal += int(same.sum())
        diff = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
        self.max_abs_diff = max(self.max_abs_diff, diff)
        if not bool(same.all()) and self.first_mismatch is None:
            self.first_mismatch = {"what": what, "max_abs_diff": diff, "elements_differing": int((~same).sum())}

    def report(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "elements_checked": self.checked,
            "elements_equal": self.equal,
            "max_abs_diff": self.max_abs_diff,
            "bitwise_equal": self.calls > 0 and self.checked == self.equal,
            "first_mismatch": self.first_mismatch,
        }


def _find_norm(norms: list[torch.nn.Module], weight: Tensor) -> torch.nn.Module:
    import torch

    for module in norms:
        if module.weight.shape == weight.shape and torch.equal(module.weight.detach().to(weight.dtype), weight):
            return module
    raise AssertionError("no trainer RMSNorm has the weight vLLM used (weights differ between the engines)")


def replay(captured: list[dict[str, Any]], hf_model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Replay captured vLLM calls through the aligned HF model; one tally per region."""
    import torch

    from rpa.core import ops
    from rpa.sides.trainer import aligned_apply_rotary_pos_emb, check_supported

    norm_cls = check_supported(hf_model).cls("RMSNorm")
    norms = [m for m in hf_model.modules() if isinstance(m, norm_cls)]
    rotary = hf_model.model.rotary_emb
    head_dim = getattr(hf_model.config, "head_dim", None) or hf_model.config.hidden_size // hf_model.config.num_attention_heads
    device = next(hf_model.parameters()).device
    tallies = {region: _Tally() for region in REGIONS}
    with torch.no_grad():
        for call in captured:
            region, inp, out = call["region"], call["inputs"], call["outputs"]
            inp = {k: v.to(device) for k, v in inp.items()}
            tally = tallies[region]
            tally.calls += 1
            if region == "rmsnorm":
                norm = _find_norm(norms, inp["weight"])
                if "residual" in inp:
                    # The HF decoder layer adds in the compute dtype (one rounding) before the norm.
                    new_residual = inp["residual"] + inp["x"]
                    tally.add("residual", new_residual.cpu(), out["residual"])
                    tally.add("rmsnorm(add)", norm(new_residual).cpu(), out["out"])
                else:
                    tally.add("rmsnorm", norm(inp["x"]).cpu(), out["out"])
            elif region == "swiglu":
                gate, up = inp["x"].chunk(2, dim=-1)
                tally.add("swiglu", ops.swiglu(gate.contiguous(), up.contiguous()).cpu(), out["out"])
            elif region == "rope":
                positions, x = inp["positions"], inp["x"]
                cos, sin = rotary(x, positions.reshape(1, -1))
                heads = x.reshape(positions.numel(), -1, head_dim).transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
                rotated, _ = aligned_apply_rotary_pos_emb(heads, heads, cos, sin)
                tally.add("rope", rotated[0].transpose(0, 1).reshape(x.shape).cpu(), out["out"])
    return {region: t.report() for region, t in tallies.items()}


def token_batch(tokenizer, prompts=DEFAULT_PROMPTS) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def _sequences(batch: list[list[int]]) -> list[dict[str, Any]]:
    """The batch as scoring records: every token after the first is scored."""
    return [{"seq": i, "prompt_ids": ids[:1], "completion_ids": ids[1:]} for i, ids in enumerate(batch)]


def _logprob_gap(a: list[list[float]], b: list[list[float]]) -> dict[str, Any]:
    import torch

    d = torch.tensor([abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)], dtype=torch.float64)
    return {"tokens": d.numel(), "mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()),
            "frac_bitwise_equal": float((d == 0).double().mean())}


def _engine_logprobs(model_dir: str, numerics: NumericsConfig, batch, **engine_kwargs) -> list[list[float]]:
    """Prompt logprobs of ``batch`` from a fresh engine (in this process; the previous one
    must be gone)."""
    from rpa.sides import engine
    from rpa.measure.scoring import sampler_logprobs

    llm = engine.make_llm(model_dir, numerics, **engine_kwargs)
    logprobs, _ = sampler_logprobs(llm, _sequences(batch), None)
    engine.close_llm(llm)  # each engine of --compiled gives its memory back before the next starts
    del llm
    engine.release_memory()
    return logprobs


def run_parity(model_dir: str, numerics: NumericsConfig, out_path: str | Path | None = None,
               options: ParityOptions | None = None) -> dict[str, Any]:
    """Run the check and write the report; ``report["passed"]`` is the verdict.

    ``numerics``: a :class:`~rpa.core.numerics_config.NumericsConfig` (regions, device);
    ``options``: :class:`ParityOptions` (default: eager, in-process, BF16 trainer weights). The
    replay check needs the aligned ops' Python bodies to run, so its engine never replays CUDA
    graphs (eager, or compiled with CUDA graphs off). With ``compiled``, the compiled engine is also
    checked as a whole: with every region aligned its prompt logprobs must equal an eager engine's
    bit for bit (with CUDA graphs on as well, on a CUDA machine); with a partial set the gap is
    reported, not gated (the stock regions are fused differently).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rpa.sides import engine
    from rpa.core.numerics_config import require_numerics
    from rpa.core.provenance import provenance
    from rpa.measure.scoring import sampler_logprobs, trainer_logprobs
    from rpa.sides.trainer import align_model

    options = options or ParityOptions()
    compiled, multiprocess, trainer_dtype = options.compiled, options.multiprocess, options.trainer_dtype
    regions = require_numerics(numerics, "run_parity").regions
    if not regions:
        raise ValueError("parity needs at least one aligned region ('none' has nothing to check)")
    device = numerics.check_device()
    cuda = device.startswith("cuda")
    replay_engine = "compiled, CUDA graphs off" if compiled and cuda else "compiled" if compiled else "eager"
    report: dict[str, Any] = {"schema": SCHEMA, "model": str(model_dir), "regions": format_regions(regions),
                              "mode": "compiled" if compiled else "eager", "trainer_dtype": trainer_dtype,
                              "device": device, "replay_engine": replay_engine, "provenance": provenance(model_dir)}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = token_batch(tokenizer)
    no_graphs = {"compilation_config": {"cudagraph_mode": "NONE"}} if compiled and cuda else {}
    try:
        llm = engine.make_llm(model_dir, numerics, enforce_eager=not compiled, multiprocess=multiprocess, **no_graphs)
    except engine.PluginNotActiveError as err:
        report.update(plugin={"active": False, "error": str(err)}, passed=False)
        _write(report, out_path)
        return report
    report["plugin"] = {"active": True, "workers": engine.worker_status(llm)}
    engine.start_capture(llm)
    vllm_logprobs, _ = sampler_logprobs(llm, _sequences(batch), None)
    captured = engine.stop_capture(llm)
    engine.close_llm(llm)  # memory back before the next engine or the trainer model
    del llm
    engine.release_memory()

    if compiled:  # the compiled engine as a whole: same bits as an eager one
        eager = _engine_logprobs(model_dir, numerics, batch, enforce_eager=True, multiprocess=multiprocess)
        check = {"compiled": _logprob_gap(vllm_logprobs, eager)}
        if cuda:
            graphs = _engine_logprobs(model_dir, numerics, batch, enforce_eager=False, multiprocess=multiprocess)
            check["compiled_cuda_graphs"] = _logprob_gap(graphs, eager)
        whole = regions == frozenset(REGIONS)
        for gap in check.values():
            gap["bitwise_equal"] = gap["frac_bitwise_equal"] == 1.0
            gap["gated"] = whole
            if not whole:
                gap["note"] = (f"not gated: with only {format_regions(regions)} aligned, the stock regions run vLLM's "
                               f"own ops, which Inductor fuses (and rounds) differently from the eager engine; only "
                               f"'all' makes the compiled engine equal the eager one. The aligned regions are checked "
                               f"inside the compiled graph by the replay above.")
        report["compiled_vs_eager"] = check

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, PRECISIONS[trainer_dtype])).to(device)
    with align_model(hf, numerics):
        report["regions_report"] = {r: v for r, v in replay(captured, hf).items() if r in regions}
        hf_logprobs = [trainer_logprobs(hf, ids[:1], ids[1:]) for ids in batch]
    report["logprobs"] = _logprob_gap(hf_logprobs, vllm_logprobs)
    report["passed"] = all(v["bitwise_equal"] for v in report["regions_report"].values()) and all(
        gap["bitwise_equal"] for gap in report.get("compiled_vs_eager", {}).values() if gap["gated"])
    _write(report, out_path)
    return report


def _write(report: dict[str, Any], out_path: str | Path | None) -> None:
    if out_path is not None:
        path = Path(out_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, report)  # atomic: a report is whole or absent
