#!/usr/bin/env bash
# Snakemake (--sdm conda) runs a copy of this file, .snakemake/conda/<hash>.post-deploy.sh, inside the
# freshly created rpa-gpu env, with its own working directory (the workflow's: the repository) as the
# current one; the copy's own path says nothing of the repository. The repository is $RPA_REPO if set,
# else this file's checkout when it runs in place (envs/..), else the current directory.
set -euo pipefail
if [ -n "${RPA_REPO:-}" ]; then
  repo="$RPA_REPO"
elif [ -f "$(dirname "${BASH_SOURCE[0]}")/../requirements/gpu.txt" ]; then
  repo="$(dirname "${BASH_SOURCE[0]}")/.."
else
  repo="$PWD"
fi
if [ ! -f "$repo/requirements/gpu.txt" ]; then
  echo "rpa-gpu post-deploy: no requirements/gpu.txt in $repo: run snakemake from the rpa repository or set RPA_REPO to it" >&2
  exit 1
fi
repo="$(cd "$repo" && pwd)"
python -m pip install -r "$repo/requirements/gpu.txt"
python -m pip install --no-deps -e "$repo"
python -m rpa.workflow.doctor
