"""What a forward saves for backward, split the way activation checkpointing and offload split it.

:class:`SavedBytes` is the arithmetic (the planner's :class:`~infinity.plan.rates.ComputeRates` measures its
three figures on real tensors, :func:`count_saved` counts them on the meta device): the root's saves (outside
the blocks), one block's saves, one block's input. With ``zero.activation_checkpointing`` a block keeps only
its input; with ``zero.activation_offload`` what the blocks keep waits in host memory or on NVMe, and device
memory holds the root's saves and two blocks' (the one in use, one in motion); NVMe-homed saves pass through
host memory, backward bringing them ahead within ``prefetch.bytes``. :func:`activation_rows` is ``infinity estimate --seq``'s table: those figures at each sequence
length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["SavedBytes", "FlashOnMeta", "count_saved", "activation_rows", "OFFLOAD_MODES", "BACKWARD_FRACTION",
           "BACKWARD_WORKING_BLOCKS"]

# backward's working set beyond the saves it starts from (:meth:`SavedBytes.backward_peak`): one block's
# worth of saves times BACKWARD_WORKING_BLOCKS for the block whose backward runs, and BACKWARD_FRACTION of
# the block saves live when backward starts; the RSS bound's slack fraction (0.25) comes on top of both
BACKWARD_WORKING_BLOCKS = 1.3
BACKWARD_FRACTION = 0.4
# (label, zero.activation_checkpointing, zero.activation_offload): the four a run chooses among
OFFLOAD_MODES = (("keep", False, "none"), ("recompute", True, "none"), ("recompute + host", True, "host"),
                 ("recompute + nvme", True, "nvme"))


@dataclass(frozen=True)
class SavedBytes:
    """Bytes a forward saves for backward (unique storages, parameters excluded): ``root`` outside the
    blocks, ``block`` inside one block, ``block_input`` one block's input; ``blocks`` of them."""

    root: int
    block: int
    block_input: int
    blocks: int

    def recomputed(self, checkpointed: int) -> int:
        """How many blocks ``checkpointed`` (:meth:`ZeroConfig.checkpointed_units`) recomputes."""
        if isinstance(checkpointed, bool):   # True would read as one block
            raise TypeError("checkpointed: a count of blocks (ZeroConfig.checkpointed_units), not a bool")
        return min(checkpointed, self.blocks)

    def offloaded(self, checkpointed: int) -> int:
        """What ``zero.activation_offload`` moves each way per step: each checkpointed block's input, every
        other block's saves."""
        k = self.recomputed(checkpointed)
        return k * self.block_input + (self.blocks - k) * self.block

    def per_block(self, checkpointed: int) -> int:
        """The most one block moves: its input if it is recomputed, else its saves."""
        k = self.recomputed(checkpointed)
        return max(self.block_input if k else 0, self.block if k < self.blocks else 0)

    def on_device(self, checkpointed: int, offload: str = "none") -> int:
        """Held in device memory at once, with ``checkpointed`` blocks recomputed: with ``offload`` none the
        root's saves and every block's; host or nvme the root's and two blocks' (the one whose backward
        runs, rebuilt from its tier, and one more being copied out or back)."""
        moved = self.offloaded(checkpointed)
        return self.root + (moved if offload == "none" else min(moved, 2 * self.per_block(checkpointed)))

    def backward_peak(self, checkpointed: int, offload: str = "none") -> int:
        """Held in device memory at backward's peak: :meth:`on_device`, plus a recomputed block's saves
        rebuilt for its backward, plus the backward's own working set. That set has two parts: the block
        whose backward runs (the gradients of its saves as they flow back, its temporaries), taken as
        :data:`BACKWARD_WORKING_BLOCKS` of one block's saves whatever is kept; and the freed blocks the
        allocator cannot hand to it, taken as :data:`BACKWARD_FRACTION` of the block saves live when
        backward starts (every kept block's, or the one rebuilt).

        Both were fitted on ``tools/bench_long_context.py`` (a 12 x 256 Llama at 2048, 4096 and 8192 tokens,
        bf16, on a 2-core EPYC with avx512_bf16, glibc's own mmap threshold): kept activations fix the second
        (peak RSS beyond the other terms grows with the 12 kept blocks' saves at about 0.5 x their bytes),
        the recomputing modes the first (it grows with one block's saves at about 1.5 x their bytes, slack
        included). A single run's peak there varies by up to 20% between rounds at 8192 tokens (915-1122 MiB
        recomputing), as glibc's heaps fragment differently."""
        k = self.recomputed(checkpointed)
        rebuilt = self.block if k else 0
        live = (self.blocks - k) * self.block + rebuilt
        working = int(BACKWARD_WORKING_BLOCKS * self.block) if self.blocks else 0
        return self.on_device(checkpointed, offload) + rebuilt + working + int(BACKWARD_FRACTION * live)

    def in_host(self, checkpointed: int, offload: str, prefetch_bytes: int = 0) -> int:
        """Held in the host tier at once: with ``offload`` host every block's saves; nvme those backward
        brings ahead (two blocks', within ``prefetch.bytes``) and two more in use or on their way."""
        moved, block = self.offloaded(checkpointed), self.per_block(checkpointed)
        if offload == "host":
            return moved
        return min(moved, min(prefetch_bytes, 2 * block) + 2 * block) if offload == "nvme" else 0

    def on_disk(self, checkpointed: int, offload: str) -> int:
        """Held on NVMe at the end of forward (``offload`` nvme)."""
        return self.offloaded(checkpointed) if offload == "nvme" else 0


class _BlockMeters:
    """Per-block saved-bytes meters: each block's forward counted apart from the rest (hooks push a meter)."""

    def __init__(self, blocks: list):
        from infinity.zero.memory_report import SavedTensorMeter
        self.meter = SavedTensorMeter()
        self.input_bytes = 0
        self._ctx: list = []
        self.handles = [h for b in blocks for h in (b.register_forward_pre_hook(self._pre),
                                                    b.register_forward_hook(self._post))]

    def _pre(self, _module, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None:
            self.input_bytes = max(self.input_bytes, x.numel() * x.element_size())
        ctx = torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack)
        ctx.__enter__()
        self._ctx.append(ctx)

    def _post(self, _module, _args, _out):
        self._ctx.pop().__exit__(None, None, None)

    def remove(self):
        for h in self.handles:
            h.remove()


class FlashOnMeta(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on meta tensors run as the fused kernel a real device runs.

    On the meta device torch picks the math path, which saves the whole (T x T) attention matrix for
    backward; a CPU (or CUDA) device runs a fused flash kernel that saves the output and one logsumexp per
    row. Counted on meta as it is, a 32k-token sequence would seem to need hundreds of GB. Here the call is
    the CPU flash kernel's own op (its meta kernel, its autograd node: what it saves), grouped-query heads
    repeated first as the math path repeats them. Dropout, and a mask the op does not take, keep the math
    path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = (list(args) + [None] * 3)[:3] if len(args) >= 3 else (kwargs.get("query"), kwargs.get("key"),
                                                                             kwargs.get("value"))
            if all(isinstance(t, torch.Tensor) and t.is_meta for t in (q, k, v)) and not kwargs.get("dropout_p"):
                return self._flash(q, k, v, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _flash(q, k, v, kwargs):
        if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, bool(kwargs.get("is_causal", False)), attn_mask=kwargs.get("attn_mask"),
            scale=kwargs.get("scale"))
        return out


def count_saved(model: nn.Module, blocks: list, forward) -> SavedBytes:
    """:class:`SavedBytes` of ``forward(model)`` (a training forward returning the loss), counted on whatever
    device the model is on (the meta device: nothing allocated, attention counted as a fused kernel saves
    it, :class:`FlashOnMeta`); ``blocks``: the unit modules."""
    from infinity.zero.memory_report import SavedTensorMeter

    root = SavedTensorMeter()
    inside = _BlockMeters(blocks)
    try:
        with torch.autograd.graph.saved_tensors_hooks(root.pack, root.unpack), FlashOnMeta():
            out = forward(model)
    finally:
        inside.remove()
    sizes = SavedBytes(root=root.peak_bytes, block=inside.meter.peak_bytes // max(len(blocks), 1),
                       block_input=inside.input_bytes, blocks=len(blocks))
    del out
    return sizes


def activation_rows(build_for_seq, seqs: list, batch: int, prefetch_bytes: int) -> list:
    """``infinity estimate``'s activation table: per sequence length, the bytes each of
    :data:`OFFLOAD_MODES` holds in device memory and in its tier (one micro-batch of ``batch`` x seq tokens
    per rank). ``build_for_seq(seq)``: ``(model on meta, its unit modules, forward(model))``."""
    rows = []
    for seq in seqs:
        model, blocks, forward = build_for_seq(seq)
        sizes = count_saved(model, blocks, forward)
        n = sizes.blocks
        modes = {label: {"device_bytes": sizes.on_device(n if ckpt else 0, off),
                         "host_bytes": sizes.in_host(n if ckpt else 0, off, prefetch_bytes),
                         "nvme_bytes": sizes.on_disk(n if ckpt else 0, off)}
                 for label, ckpt, off in OFFLOAD_MODES}
        rows.append({"seq": seq, "batch": batch, "saved": asdict(sizes), "modes": modes})
    return rows
