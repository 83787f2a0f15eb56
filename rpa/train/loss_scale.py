"""Dynamic loss scaling for FP16 compute on FP32 master weights (the FP16 arm, Precision-RL).

With FP16 activations the backward pass underflows: GRPO's DAPO loss is normalised by the
step's tokens (~1e4-1e5), so a sampled token's logit gradient is ~1e-5 and smaller ones flush
to zero in FP16 (on a tiny Qwen3 with a 6e4-token normaliser: 0.8% of gradient entries zero,
cosine 0.958 to the FP32 gradient; with a 2^16 scale: cosine 1.0000, 6e-6 zero --
tests/test_loss_scale.py). The loss is multiplied by ``scale`` before the backward pass, the
FP32 master gradients are divided by it before clipping and the optimizer step, a step whose
gradients are not finite is skipped and the scale halved, and after ``growth_interval`` clean
steps it doubles -- the rules of ``torch.amp.GradScaler``, written out so that the FP16 compute
path (FP32 masters, FP16 matmuls, no autocast) can use them without autocast. The scale is not
checkpointed: a resumed run starts again at ``2**16`` and backs off within a few steps if needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch


@dataclass
class DynamicLossScale:
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = field(default=0)
    skipped_steps: int = field(default=0)

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale in place; True if any is not finite. One host sync
        per call (the parameters' flags stay on their device until then); an FSDP2 gradient (a
        DTensor) is checked shard by shard and the ranks agree in one all-reduce, so that every
        rank skips the same steps."""
        inv = 1.0 / self.scale
        finite, sharded = [], False
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                sharded = sharded or grad is not p.grad
                finite.append(torch.isfinite(grad).all())
        if not finite:
            return False
        device = finite[0].device
        found = ~torch.stack([f.to(device) for f in finite]).all()
        if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
            found = found.float()
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        return bool(found)

    def update(self, found_inf: bool) -> None:
        """After a step: back off on an overflow (that step was skipped), grow after a clean run."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
