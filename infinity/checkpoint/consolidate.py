"""``consolidate``: a sharded checkpoint to one state dict in safetensors files, in bounded memory.

Output: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (the Hugging Face layout) when the tensors
exceed ``max_shard_bytes``; keyed by the model's own ``state_dict()`` names
(every name of a tied parameter, buffers and frozen parameters included); and,
for a ``transformers`` model, ``config.json``, so ``from_pretrained(out)`` loads it.

Memory: each parameter is copied from the rank files in pieces of at most
``buffer_bytes`` of fp32 (plus its cast when ``dtype`` is bf16), straight
from the rank files that hold it into the output file, so peak tensor memory
is about ``buffer_bytes`` whatever the size of the model or of one parameter.
A larger buffer means fewer, larger reads and writes. A checkpoint saved with
tensor parallelism yields the same plain state dict: each split parameter is
reassembled whole from its ``tp`` slices first (then peak memory is one whole
parameter, fp32), replicated ones are read from ``tp`` rank 0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from infinity.checkpoint.manifest import Checkpoint
from infinity.checkpoint.shard_reader import ShardReader
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader, TensorFileWriter
from infinity.checkpoint.tp_layout import read_full_param, saved_spec
from infinity.io.new_files import make_private_dir, replaced, temp_name
from infinity.parallel.tensor_parallel import full_shape

__all__ = ["consolidate", "OUTPUT_DTYPES"]

OUTPUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def consolidate(checkpoint, out_dir, dtype: str = "fp32", max_shard_bytes: int = 2 * 2**30,
                buffer_bytes: int = 64 * 2**20) -> dict:
    """Write ``checkpoint``'s model state to ``out_dir``; returns a summary (files, tensors, bytes).

    ``checkpoint``: a step directory or root, or a list of them (a node-local checkpoint: every node's)."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"consolidate: dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1 or buffer_bytes < 16:
        raise ValueError(f"consolidate: max_shard_bytes ({max_shard_bytes}) and buffer_bytes ({buffer_bytes}) "
                         "must be positive (buffer_bytes >= 16)")
    ckpt = Checkpoint(checkpoint)
    out_dtype = OUTPUT_DTYPES[dtype]
    tensors = _plan_tensors(ckpt, out_dtype)
    files = _split(tensors, max_shard_bytes)
    out = Path(out_dir)
    _make_out_dir(out)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    # fp32 read piece + its cast fit in buffer_bytes
    piece_numel = max(1, buffer_bytes // (4 + (out_dtype.itemsize if out_dtype != torch.float32 else 0)))
    reader = ShardReader(ckpt, tensors=("master",))  # the moments are neither read nor verified
    extras = TensorFileReader(ckpt.verify(*ckpt.extras_source()), "checkpoint extras") \
        if ckpt.manifest["extras"] else None
    total_bytes, open_unit = 0, -1
    try:
        for fname, group in zip(names, files):
            # written under a new temporary name, then renamed onto the name: a file or a symlink already
            # there is replaced as a whole, a symlink's target is never written through
            tmp = temp_name(out / fname)
            writer = TensorFileWriter(tmp, [(t["key"], t["dtype"], t["shape"]) for t in group],
                                      {"format": "pt"})
            try:
                for t in group:
                    if t["source"] == "unit" and t["unit"] != open_unit:
                        reader.close_unit(open_unit)  # state_dict order visits units mostly in turn
                        open_unit = t["unit"]
                    if t["source"] == "unit" and t["split"]:
                        full = read_full_param(reader, ckpt, t["unit"], t["slot"], "master").reshape(-1)
                        for lo in range(0, full.numel(), piece_numel):
                            writer.write(full[lo:lo + piece_numel].to(t["dtype"]))
                    elif t["source"] == "unit":
                        _copy_param(reader, t, writer, piece_numel)
                    else:
                        writer.write(extras.read(t["key"]).to(t["dtype"]).reshape(-1))
                total_bytes += writer.close()["bytes"]
                os.replace(tmp, out / fname)
            except BaseException:
                writer.abort()
                if os.path.lexists(tmp):
                    os.unlink(tmp)
                raise
    finally:
        reader.close()
        if extras is not None:
            extras.close()
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(t["bytes"] for g in files for t in g)},
                 "weight_map": {t["key"]: fname for fname, g in zip(names, files) for t in g}}
        with replaced(out / "model.safetensors.index.json", "w") as f:
            f.write(json.dumps(index, indent=2))
    wrote = list(names) + (["model.safetensors.index.json"] if len(files) > 1 else [])
    if "hf_config.json" in ckpt.files:
        cfg = json.loads(ckpt.verify("hf_config.json", 0).read_bytes())
        for key in ("torch_dtype", "dtype"):  # transformers moved the name; set whichever it uses
            if key in cfg:
                cfg[key] = _HF_DTYPE_NAMES[dtype]
        with replaced(out / "config.json", "w") as f:
            f.write(json.dumps(cfg, indent=2))
        wrote.append("config.json")
    return {"checkpoint": ", ".join(map(str, ckpt.dirs)), "out": str(out), "dtype": dtype, "files": wrote,
            "tensors": len(tensors), "bytes": total_bytes, "step": ckpt.manifest["step"]}


def _make_out_dir(out: Path) -> None:
    """``out`` and any missing parents, new ones private (0700); one line naming the path when it cannot be."""
    try:
        if not out.is_dir():
            if not os.path.lexists(out.parent):   # a file in the way fails below, as 'Not a directory'
                out.parent.mkdir(parents=True, exist_ok=True)
            make_private_dir(out, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"consolidate: cannot create the output directory {out}: {e.strerror or e}; "
                              "give a writable directory") from None


def _plan_tensors(ckpt: Checkpoint, out_dtype: torch.dtype) -> list:
    """One entry per state_dict key, in state_dict order: where its data is and what it becomes."""
    slot_of = {}
    for ui, unit in enumerate(ckpt.units):
        for slot in unit["slots"]:
            for name in slot["names"]:
                slot_of[name] = (ui, slot)
    extra_specs = {}
    if ckpt.manifest["extras"]:
        with TensorFileReader(ckpt.verify(*ckpt.extras_source()), "checkpoint extras") as f:
            extra_specs = {n: (f.entry(n)[0], f.entry(n)[1]) for n in ckpt.manifest["extras"]}
    out = []
    for key in ckpt.manifest["state_dict_keys"]:
        if key in slot_of:
            ui, slot = slot_of[key]
            spec = saved_spec(ckpt, slot["name"])
            shape, dtype = tuple(full_shape(slot["shape"], spec, ckpt.tp_size)), out_dtype
            entry = {"source": "unit", "unit": ui, "offset": int(slot["offset"]), "numel": int(slot["numel"]),
                     "split": spec is not None, "slot": slot}
        elif key in extra_specs:
            dtype, shape = extra_specs[key]
            dtype = out_dtype if dtype.is_floating_point else dtype  # buffers follow the model's dtype
            entry = {"source": "extras"}
        else:
            raise CheckpointError(f"checkpoint {ckpt.dir}: state_dict key {key!r} is neither a unit parameter nor "
                                  "a saved extra (manifest inconsistent)")
        numel = 1
        for d in shape:
            numel *= d
        entry.update(key=key, shape=shape, dtype=dtype, bytes=numel * dtype.itemsize)
        out.append(entry)
    return out


def _split(tensors: list, max_shard_bytes: int) -> list:
    """Greedy, in order: a new file when the next tensor would pass the cap (a lone big tensor gets its own)."""
    files, current, size = [], [], 0
    for t in tensors:
        if current and size + t["bytes"] > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(t)
        size += t["bytes"]
    if current or not files:
        files.append(current)
    return files


def _copy_param(reader: ShardReader, t: dict, writer: TensorFileWriter, piece_numel: int) -> None:
    buf = torch.empty(min(piece_numel, max(t["numel"], 1)), dtype=torch.float32)
    start, end = t["offset"], t["offset"] + t["numel"]
    for lo in range(start, end, piece_numel):
        hi = min(lo + piece_numel, end)
        piece = buf[:hi - lo]
        reader.read(t["unit"], "master", lo, hi, piece)
        writer.write(piece if t["dtype"] == torch.float32 else piece.to(t["dtype"]))
