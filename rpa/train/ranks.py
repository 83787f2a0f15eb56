"""The processes of a multi-process run meeting outside training's collectives: the other ranks wait for
rank 0's held-out evaluation in a group of their own (torch.distributed only: no TRL, no vLLM)."""

from __future__ import annotations

from rpa.core.runlog import world_size


def evaluation_group(timeout_s: float, holder):
    """The process group (gloo, ``timeout_s``) in which the other processes of a multi-process run
    wait for rank 0's held-out evaluation (:func:`wait_for_rank0`), instead of in the next collective
    of training, whose timeout (the process group's: NCCL's 30 min by default) one evaluation can pass
    on a slow GPU. Made on first use, by every rank together and before rank 0 evaluates (its
    rendezvous has the default group's timeout), kept on ``holder``; None in one process."""
    import torch.distributed as dist

    if world_size() <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    group = getattr(holder, "_rpa_eval_group", None)
    if group is None:
        from datetime import timedelta

        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        holder._rpa_eval_group = group
    return group


def wait_for_rank0(group) -> None:
    """Every rank meets in ``group`` (:func:`evaluation_group`): the others once rank 0 is done."""
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)
