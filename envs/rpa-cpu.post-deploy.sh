#!/usr/bin/env bash
# Snakemake runs this inside the freshly created rpa-cpu env.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python -m pip install --no-deps --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" "torch==2.13.0+cpu"
python -m pip install --no-deps -r "$repo/requirements/cpu.txt"
python -m pip install --no-deps -e "$repo"
python -m rpa.workflow.doctor
