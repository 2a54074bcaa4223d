"""ShardJob: one shard's optimizer step, as :class:`~infinity.optim.pipeline.AdamPipeline` takes it.

Names the shard's tensors (store keys or in-memory tensors), its param groups' element ranges, and
what becomes of each host copy once the update is done; the pipeline keeps its own per-run
bookkeeping on the job in the private fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["ShardJob"]


@dataclass
class ShardJob:
    """One shard's optimizer step. Each field is a store key (str) or an in-memory tensor.

    ``param_out`` is the compute-precision parameter written in the same pass
    (None: the fp32 master *is* the parameter). ``ranges`` are
    ``(group_index, lo, hi)`` element ranges with their own hyper-parameters.
    ``on_done(param)`` runs on the caller's thread in ``finish`` (or ``wait_for``), in job order, once the update
    landed, with the updated parameter (e.g. to launch its all-gather) — before any write-back
    of it completes, which is fine: the in-memory copy is already final.
    ``grad_scale`` multiplies the gradient as Adam reads it (fp16 unscale, clipping).
    ``discard`` names store keys whose host copy is dropped unwritten once the update is done
    (a consumed gradient: writing it home would be wasted I/O).
    ``drop`` names written store keys whose host copy is dropped once it is home (evicted, not
    cached): states streamed through a host budget too small to keep them until their next use.
    ``write_home`` names keys the update reads and does not change whose host copy is written home
    (if it is the newest) and dropped once the update is done: a gradient a speculative update keeps
    for a redo, where the host budget cannot hold it until the step is decided.
    ``master_is_remainder``: ``master`` is a split master's int16 remainder (``optimizer.master:
    remainder``), so ``param_out`` is read as well as written: the fp32 master is the two joined.
    ``moments_blocked``: ``exp_avg`` / ``exp_avg_sq`` are int8 rows of blocks (``optimizer.moments: int8``,
    :mod:`~infinity.optim.moment_codes`), updated a whole job at a time; their stochastic rounding is a
    function of ``unit_index`` and of each element's index in the unit's flat buffer (the job's first
    is ``element_offset``), so any chunking or tier gives the same result.
    ``sources`` (a speculative update, :mod:`infinity.zero.speculation`): ``{field: key or tensor}`` for
    written fields whose old value is read from elsewhere. The field (a spare key or tensor) is then
    filled with the source's bytes before Adam updates it in place, and the source is left as it was
    (read, never written), so the update can be dropped or redone from it. A source key homed beyond
    the host tier hands its host copy over to the field's key (:meth:`TensorStore.hand_over`: no copy,
    no more room; the source keeps its home bytes); a host-homed source is copied.
    """

    name: str
    master: str | torch.Tensor
    exp_avg: str | torch.Tensor
    exp_avg_sq: str | torch.Tensor
    grad: str | torch.Tensor
    param_out: str | torch.Tensor | None
    ranges: list
    on_done: Callable | None = None
    grad_scale: float = 1.0
    discard: tuple = ()
    drop: tuple = ()
    write_home: tuple = ()
    master_is_remainder: bool = False
    moments_blocked: bool = False
    unit_index: int = 0
    element_offset: int = 0
    sources: dict = field(default_factory=dict)
    _keys: list = field(default_factory=list, repr=False)
    _handover: dict = field(default_factory=dict, repr=False)   # field -> (source key, field key)
    _grads_ready: object = field(default=None, repr=False)   # CUDA-only: event after the gradient's kernels
    _submitted_s: float = field(default=0.0, repr=False)
    _room_bytes: int = field(default=0, repr=False)   # what it was promised of the look-ahead room
