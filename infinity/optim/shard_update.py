"""One shard job's AdamW on its tensors once they are in memory, wherever the states live.

Host-resident states go through :class:`~infinity.optim.cpu_adam.CpuAdamW`; states kept in device
memory (CUDA) are updated where they live by torch's fused kernel
(:func:`~infinity.optim.cpu_adam.device_adamw_`, :func:`~infinity.optim.cpu_adam.device_adamw_blocks_`).
fp32 / bf16 moments are updated one param group's range at a time (:func:`update_flat`); int8 moments
(``optimizer.moments: int8``) a whole job at a time (:func:`update_blocked`). ``t`` holds the job's
tensors by field name, ``hyper(group_index)`` a group's ``step, lr, betas, eps, weight_decay``. Moving
the tensors in and out is :class:`~infinity.optim.pipeline.AdamPipeline`'s job.
"""

from __future__ import annotations

import torch

from infinity.optim.cpu_adam import CpuAdamW, device_adamw_, device_adamw_blocks_, write_param_
from infinity.optim.shard_job import ShardJob
from infinity.optim.split_master import join_bf16_, split_bf16_

__all__ = ["update_flat", "update_blocked"]


def update_flat(adam: CpuAdamW, job: ShardJob, t: dict, master, grad, out, hyper) -> None:
    """fp32 / bf16 moments: each param group's range of the job by :meth:`CpuAdamW.step_` on the CPU,
    by the device's kernel where the states are in device memory."""
    for group, lo, hi in job.ranges:
        h = hyper(group)
        o = out[lo:hi] if out is not None else None
        if master.device.type == "cpu":
            adam.step_(master[lo:hi], grad[lo:hi], t["exp_avg"][lo:hi], t["exp_avg_sq"][lo:hi],
                       step=h["step"], lr=h["lr"], betas=h["betas"], eps=h["eps"],
                       weight_decay=h["weight_decay"], out=o, grad_scale=job.grad_scale)
        else:   # CUDA-only: states in device memory, updated there by torch's fused kernel
            m32 = join_bf16_(o, master[lo:hi], torch.empty(hi - lo, dtype=torch.float32, device=master.device)) \
                if job.master_is_remainder else master[lo:hi]
            moments = (t["exp_avg"][lo:hi], t["exp_avg_sq"][lo:hi])
            wide = [x.float() for x in moments]   # the math is fp32 whatever the moments' stored format
            device_adamw_(m32, grad[lo:hi].float() * job.grad_scale, *wide, step=h["step"], lr=h["lr"],
                          beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"])
            for x, w in zip(moments, wide):
                if x is not w:
                    x.copy_(w)
            if job.master_is_remainder:
                split_bf16_(m32, o, master[lo:hi])
            elif o is not None:
                write_param_(m32, o)


def update_blocked(adam: CpuAdamW, job: ShardJob, t: dict, master, grad, out, hyper) -> None:
    """int8 moments: one call for the whole job (a block may hold two param groups' elements).
    On the CPU, :meth:`CpuAdamW.step_segments_` decodes and encodes per cache-sized chunk; a job held
    in device memory (CUDA-only) is decoded whole, updated per range and encoded back."""
    # CUDA-only: states in device memory take device_adamw_blocks_
    update = adam.step_segments_ if master.device.type == "cpu" else device_adamw_blocks_
    update(master, grad, t["exp_avg"], t["exp_avg_sq"], [(lo, hi, hyper(group)) for group, lo, hi in job.ranges],
           out=out, grad_scale=job.grad_scale, seed=job.unit_index, index=job.element_offset)
