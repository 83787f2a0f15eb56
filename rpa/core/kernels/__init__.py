"""Fused CUDA kernels (Triton) for the three aligned regions.

:mod:`rpa.core.kernels.triton_regions` mirrors :mod:`rpa.core.numerics` one function for one: FP32
internals and exactly one rounding per output, each output row computed by one program
whose reduction order depends only on the row length, so a row gives the same bits alone
or in a batch of any size. Nothing here is imported unless :mod:`rpa.core.ops` picks the Triton
backend for a CUDA tensor; the CPU path is the pure-torch :mod:`rpa.core.numerics` on both sides.
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> tuple[bool, str]:
    """Whether the Triton kernels can run here, and why not."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return False, "no CUDA device"
    return True, ""
