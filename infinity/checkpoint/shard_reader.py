"""Reading element ranges of a unit's saved tensors, whichever saved ranks' files hold them.

Saved rank ``r`` held elements ``[r * shard_numel, (r + 1) * shard_numel)``
of each unit's flat buffer; :meth:`Checkpoint.unit_sources` cuts a range into
per-file pieces and :class:`ShardReader` ``pread``s each piece into place,
verifying each file (its header and the tensors this reader reads) on first use.
Used by ``load_checkpoint`` (this rank's new shard) and ``consolidate`` (one
parameter at a time).
"""

from __future__ import annotations

import torch

import math

from infinity.checkpoint.manifest import SCALE_SUFFIX, SHARD_TENSORS, Checkpoint
from infinity.checkpoint.tensor_file import TensorFileReader
from infinity.optim.moment_codes import BLOCK, decode_codes_
from infinity.zero.units import TensorClass

__all__ = ["ShardReader"]


class ShardReader:
    """Reads element ranges of a unit's saved tensors from whichever rank files hold them."""

    def __init__(self, ckpt: Checkpoint, tensors=SHARD_TENSORS):
        self.ckpt = ckpt
        # the saved tensors this reader will read (only those are verified), int8 moments' scales included
        self.tensors = ckpt.saved_tensors(tensors)
        self._open: dict = {}

    def files_for(self, unit_index: int, lo: int, hi: int, tp_rank: int = 0) -> list:
        return [(r, rel) for r, rel, *_ in self.ckpt.unit_sources(unit_index, lo, hi, tp_rank)]

    def read(self, unit_index: int, name: str, lo: int, hi: int, out: torch.Tensor, tp_rank: int = 0) -> None:
        """Unpadded elements [lo, hi) of saved tensor ``name`` of (saved tensor-parallel rank ``tp_rank``'s)
        unit ``unit_index`` into fp32 CPU ``out``; moments saved bf16 (``optimizer.moments: bf16``) are
        widened, and ones saved int8 decoded, exactly."""
        for r, rel, a, b, at in self.ckpt.unit_sources(unit_index, lo, hi, tp_rank):
            reader = self._reader(rel, r)
            saved = reader.entry(name)[0]
            if saved == out.dtype:
                reader.read_into(name, a, b, out[at:at + b - a])
            elif saved == torch.float8_e4m3fn:
                out[at:at + b - a].copy_(self._decoded(reader, name, a, b))
            else:
                narrow = torch.empty(b - a, dtype=saved)
                reader.read_into(name, a, b, narrow)
                out[at:at + b - a].copy_(narrow)

    @staticmethod
    def _decoded(reader: TensorFileReader, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of an int8 moment: the whole blocks holding them read and decoded (a saved
        shard is whole blocks), then cut to the range."""
        first, last = a // BLOCK, math.ceil(b / BLOCK)
        codes = torch.empty(last - first, BLOCK, dtype=torch.float8_e4m3fn)
        scales = torch.empty(last - first, 1, dtype=torch.float32)
        reader.read_into(name, first * BLOCK, last * BLOCK, codes.view(-1))
        reader.read_into(name + SCALE_SUFFIX, first, last, scales.view(-1))
        values = decode_codes_(codes, scales, torch.empty(codes.numel()), squared=name == TensorClass.EXP_AVG_SQ.value)
        return values[a - first * BLOCK:b - first * BLOCK]

    def _reader(self, rel: str, rank: int) -> TensorFileReader:
        if rel not in self._open:
            path = self.ckpt.verify(rel, rank, self.tensors)
            self._open[rel] = TensorFileReader(path, f"checkpoint file written by rank {rank}")
        return self._open[rel]

    def close_unit(self, unit_index: int) -> None:
        """Units are read one after another; their files need not stay open."""
        for rel in [k for k in self._open if k.endswith(f"/unit{unit_index:04d}.safetensors")]:
            self._open.pop(rel).close()

    def close(self) -> None:
        for r in self._open.values():
            r.close()
        self._open.clear()
