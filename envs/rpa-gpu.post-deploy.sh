#!/usr/bin/env bash
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python -m pip install -r "$repo/requirements/gpu.txt"
python -m pip install --no-deps -e "$repo"
python -m rpa.workflow.doctor
