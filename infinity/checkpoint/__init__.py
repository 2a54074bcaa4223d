"""Sharded checkpoints: atomic save, load at any world size and stage, consolidation to safetensors.

- :func:`save_checkpoint` — every rank writes its own unit shards (one unit at
  a time), RNG state and checksummed index; rank 0 publishes atomically.
- :func:`load_checkpoint` — verifies checksums, reshards by element ranges.
- :func:`consolidate` — one state dict (HF safetensors layout), streamed.

Files: ``manifest.py`` (layout, validation), ``tensor_file.py`` (streamed
safetensors I/O), ``train_state.py`` (RNG, optimizer steps, loss scaler),
``shard_reader.py`` (element ranges across saved ranks), ``save.py``, ``load.py``,
``consolidate.py``.
"""

from infinity.checkpoint.consolidate import consolidate
from infinity.checkpoint.load import load_checkpoint
from infinity.checkpoint.save import save_checkpoint
from infinity.checkpoint.tensor_file import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "CheckpointError"]
