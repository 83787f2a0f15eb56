"""Starting vLLM with a region set, and checking from inside its workers that it took.

The region set reaches every vLLM process through :data:`rpa.core.regions.ENV_VAR`
(:func:`rpa.core.regions.to_env`); it is fixed per process (see :mod:`rpa.sides.vllm_plugin`).
:func:`make_llm` sets it, starts the engine and runs :func:`verify_plugin`, which fails closed.
Every entry point here takes a :class:`~rpa.core.numerics_config.NumericsConfig`.
"""

from __future__ import annotations

import os
from typing import Any

from rpa.core.numerics_config import NumericsConfig, perturbation_label, require_numerics
from rpa.core.regions import REGIONS, format_regions, region_label, to_env
from rpa.sides.vllm_plugin import PERTURB_ENV


DEFAULT_MAX_MODEL_LEN = 1024
"""vLLM's context (``max_model_len``) in :func:`make_llm` where the caller gives none; a model whose
``max_position_embeddings`` is shorter gets that instead (:func:`engine_context`)."""


def engine_context(config, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> int:
    """The context an engine on a model of HF ``config`` runs with: ``max_model_len``, or the model's
    ``max_position_embeddings`` where shorter (vLLM refuses a context past it, with a traceback)."""
    limit = getattr(config, "max_position_embeddings", None)
    return min(max_model_len, int(limit)) if limit else max_model_len


def max_n_sequences() -> int:
    """vLLM's bound on the completions of one request (``SamplingParams.n``):
    ``vllm.envs.VLLM_MAX_N_SEQUENCES`` (16384 unless that environment variable sets another)."""
    import vllm.envs

    return int(vllm.envs.VLLM_MAX_N_SEQUENCES)


class PluginNotActiveError(RuntimeError):
    """The vLLM engine does not run the requested alignment."""


def _worker_status(worker) -> dict[str, Any]:
    from rpa.sides.vllm_plugin import plugin_status

    return plugin_status(worker.model_runner.get_model())


def _worker_start_capture(worker) -> None:
    from rpa.sides.vllm_plugin import start_capture

    start_capture()


def _worker_stop_capture(worker) -> list[dict[str, Any]]:
    from rpa.sides.vllm_plugin import stop_capture

    return stop_capture()


def _worker_reseed(worker) -> None:
    from vllm.utils.torch_utils import set_random_seed

    set_random_seed(worker.model_config.seed, worker.parallel_config.data_parallel_index)


def reseed_engine(llm) -> None:
    """Seed every worker of ``llm`` as a new engine seeds itself at the end of its start-up
    (``random``, NumPy and torch from the engine's ``seed``): an engine taken over by the next
    run of a process then samples as a freshly started one would."""
    llm.collective_rpc(_worker_reseed)


def worker_status(llm) -> list[dict[str, Any]]:
    """:func:`rpa.sides.vllm_plugin.plugin_status` from every worker of ``llm``."""
    return llm.collective_rpc(_worker_status)


def start_capture(llm) -> None:
    llm.collective_rpc(_worker_start_capture)


def stop_capture(llm) -> list[dict[str, Any]]:
    """Captured aligned-op calls of all workers, concatenated."""
    return [call for calls in llm.collective_rpc(_worker_stop_capture) for call in calls]


def verify_plugin(llm, numerics: NumericsConfig) -> list[dict[str, Any]]:
    """Fail closed unless every worker aligns exactly the sampler's regions of ``numerics`` in every
    matching layer and perturbs the sampler exactly as it asks (its mantissa bits, or none)."""
    from rpa.core.ops import backend_report

    numerics = require_numerics(numerics, "verify_plugin")
    regions, perturbation = numerics.sampler_process_key
    statuses = worker_status(llm)
    want = format_regions(regions)
    kernels = backend_report()
    problems = []
    for st in statuses:
        where = f"worker pid {st['pid']}"
        if not st["loaded"]:
            problems.append(f"{where}: rpa plugin was not loaded (is the package installed, VLLM_PLUGINS unset?)")
            continue
        if st["regions"] != want:
            problems.append(f"{where}: plugin aligns {st['regions']!r}, requested {want!r} "
                            f"(the region set is fixed per process; start a new one)")
        if st.get("perturbation") != perturbation:
            problems.append(f"{where}: sampler perturbation {st.get('perturbation')!r}, requested {perturbation!r}")
        perturbed = st.get("perturbed_layers", {})
        if perturbation is not None and any(not perturbed.get(r) for r in REGIONS):
            problems.append(f"{where}: the dose reached only {perturbed} of the three regions' layers")
        if perturbation is None and perturbed:
            problems.append(f"{where}: layers {perturbed} are perturbed although no dose was requested")
        if st.get("kernels") != kernels:
            problems.append(f"{where}: kernel backend {st.get('kernels')} differs from this process's {kernels} "
                            f"(both sides must run the same kernels; set RPA_KERNELS alike)")
        for region in REGIONS:
            aligned = st["aligned_layers"].get(region, 0)
            stock = st["stock_layers"].get(region, 0)
            if region in regions and (aligned == 0 or stock):
                problems.append(f"{where}: region {region!r}: {aligned} aligned and {stock} stock layers")
            if region not in regions and aligned:
                problems.append(f"{where}: region {region!r} is aligned but was not requested")
    if problems:
        raise PluginNotActiveError("vLLM alignment check failed:\n  " + "\n  ".join(problems))
    return statuses


CACHE_BASE_ENV = "RPA_VLLM_CACHE_BASE"
"""The user's vLLM cache root, remembered before :func:`make_llm_env` points
``VLLM_CACHE_ROOT`` at a per-configuration subdirectory of it."""


def cache_base() -> str:
    """The vLLM cache root the per-configuration roots go under: :data:`CACHE_BASE_ENV` once set,
    else the user's ``VLLM_CACHE_ROOT``, else vLLM's default (``$XDG_CACHE_HOME/vllm``)."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm")
    return os.path.expanduser(os.environ.get(CACHE_BASE_ENV) or os.environ.get("VLLM_CACHE_ROOT", default))


def compile_cache_key(numerics: NumericsConfig) -> str:
    """What vLLM's compile-cache key lacks: the sampler's region set (and dose) and the kernel backend.

    vLLM (torch >= 2.10) caches compiled graphs under ``VLLM_CACHE_ROOT`` keyed by its
    config, its environment variables and the traced source files -- not by ``RPA_REGIONS``
    or by which layers the plugin replaced. Two region sets on one model would share (and
    on CUDA load) one another's graphs; one cache root per key keeps them apart.
    """
    from rpa.core.ops import backend_report

    regions, perturbation = require_numerics(numerics, "compile_cache_key").sampler_process_key
    kernels = backend_report()
    dose = "" if perturbation is None else f"-{perturbation_label(perturbation)}"
    return f"rpa-{region_label(regions)}{dose}-kernels-{kernels['cuda'] or kernels['cpu']}"


MODEL_INFO_CACHE = "modelinfos"
"""vLLM's cache of each model class's inspected properties, ``VLLM_CACHE_ROOT/modelinfos`` (vllm 0.32,
``_LazyRegisteredModel``): one JSON file per class, keyed by the hash of the class's source file -- nothing of
the region set. A miss costs a subprocess that imports vLLM and the model's module (~6 s of CPU on 2 cores)."""


def share_model_info_cache(root: str, base: str) -> None:
    """Point the per-configuration root's :data:`MODEL_INFO_CACHE` at one folder under ``base``, so that
    a model class is inspected once, not once per region set (:func:`compile_cache_key` separates the
    compiled graphs only). A root that already has its own folder keeps it (vLLM reads either); a link that
    leads nowhere (a copied or moved root) is made again; two processes linking at once leave one link. Where
    links cannot be made (a file system without them), each root keeps its own folder, as vLLM makes it: the
    cache only saves time."""
    shared = os.path.join(base, MODEL_INFO_CACHE)
    link = os.path.join(root, MODEL_INFO_CACHE)
    try:
        os.makedirs(shared, exist_ok=True)
        os.makedirs(root, exist_ok=True)
        if os.path.islink(link) and not os.path.exists(link):
            os.unlink(link)  # dangling: vLLM could write nothing through it
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(shared, root), link)  # relative: the cache folder can move
    except OSError:  # another process linked (or vLLM made the folder) first, or no links here: a folder per root
        pass


def make_llm_env(numerics: NumericsConfig, *, multiprocess: bool = False, kv_cache_gib: int = 1) -> None:
    """Set the environment a vLLM engine started after this call in this process reads, for a
    :class:`~rpa.core.numerics_config.NumericsConfig`: the plugin's region set
    (:func:`rpa.core.regions.to_env`) and sampler perturbation, their compile-cache root
    (:func:`compile_cache_key`; its model-info cache shared, :func:`share_model_info_cache`), in-process or
    multiprocess engine core, CPU KV-cache size."""
    regions, bits = require_numerics(numerics, "make_llm_env").sampler_process_key
    os.environ.update(to_env(regions))
    os.environ[PERTURB_ENV] = "none" if bits is None else f"mantissa_bits={bits}"
    os.environ[CACHE_BASE_ENV] = cache_base()
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(os.environ[CACHE_BASE_ENV], compile_cache_key(numerics))
    share_model_info_cache(os.environ["VLLM_CACHE_ROOT"], os.environ[CACHE_BASE_ENV])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    # collective_rpc ships the status/capture callables to the engine process by pickle.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


def make_llm(model: str, numerics: NumericsConfig, *, enforce_eager: bool = True, multiprocess: bool = False,
             seed: int = 0, max_model_len: int = DEFAULT_MAX_MODEL_LEN, kv_cache_gib: int = 1, **llm_kwargs):
    """A ``vllm.LLM`` for a :class:`~rpa.core.numerics_config.NumericsConfig`: its plugin aligns the
    sampler's regions, verified in every worker; dtype and LM-head dtype come from the configuration.

    ``multiprocess=False`` runs the engine in this process (fast start); ``True`` uses
    vLLM's default engine-core process (callers then need an ``if __name__ ==
    "__main__"`` guard).
    """
    from rpa.sides import vllm_plugin

    want = require_numerics(numerics, "make_llm").sampler_process_key
    loaded = (vllm_plugin._STATE["regions"], vllm_plugin._STATE["perturbation"])
    if vllm_plugin._STATE["loaded"] and loaded != want:
        raise PluginNotActiveError(
            f"this process already loaded the rpa plugin with regions {format_regions(loaded[0])!r} and sampler "
            f"perturbation {loaded[1]!r}; {format_regions(want[0])!r} / {want[1]!r} needs a new process"
        )
    make_llm_env(numerics, multiprocess=multiprocess, kv_cache_gib=kv_cache_gib)
    from vllm import LLM

    llm = LLM(model=model, enforce_eager=enforce_eager, seed=seed, max_model_len=max_model_len,
              **{**numerics.vllm_kwargs(), **llm_kwargs})
    verify_plugin(llm, numerics)
    return llm


def close_llm(llm) -> None:
    """Shut ``llm``'s engine down before the trainer side loads: a colocated engine keeps
    ``gpu_memory_utilization`` (vLLM's default 0.92) of the GPU, and an HF model loaded beside it
    would have to fit in the rest. The caller then drops its reference and calls
    :func:`release_memory`."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()


def release_memory() -> None:
    """Collect dropped engines and models and empty the CUDA cache."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
