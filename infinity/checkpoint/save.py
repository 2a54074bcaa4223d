"""``save_checkpoint``: every rank writes its own shards, then rank 0 publishes the directory atomically.

Order (each step's constraint):

1. rank 0 picks a temp name ``.tmp-step_N-<uuid>`` and tells every rank (they must write into one directory);
2. every rank writes its unit files one unit at a time (peak memory: one unit shard's states), its RNG
   state, then its ``index.json`` of checksums, fsyncing each file and its directory (the rename in 4
   must not become durable before the data it publishes);
3. every rank reports success or its error to all (a rank that failed, e.g. on a full disk, makes every
   rank raise, and rank 0 removes the temp directory; the previous checkpoint is never touched);
4. rank 0 writes ``manifest.json`` (with each index's checksum), fsyncs, renames the temp directory to
   ``step_N``, fsyncs the parent, replaces ``latest`` (temp + rename), then prunes beyond ``keep_last``;
5. every rank waits for rank 0's outcome, so no rank returns before the checkpoint exists.

Node-local (``node_local=True``: nodes without a shared file system) the same steps run with each node's
lowest rank in rank 0's place for its node's directory: it makes the temp directory (finding another
node's there means the directories are shared, and is refused), writes rank 0's manifest, renames; the
renames of every node are agreed on before any ``latest`` moves or anything is pruned (a node whose
rename failed leaves the others to undo theirs).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from infinity.checkpoint.manifest import (FORMAT, FORMAT_VERSION, SCALE_SUFFIX, SHARD_TENSORS, STEP_DIR_RE,
                                          rank_dir, step_dir_name, unit_file, unit_layout, write_json)
from infinity.checkpoint.tensor_file import DTYPE_CODES, CheckpointError, TensorFileWriter, fsync_dir
from infinity.comm.node_layout import gather_node_layout
from infinity.checkpoint.tp_layout import tp_manifest
from infinity.io.new_files import replaced
from infinity.optim.split_master import join_bf16_
from infinity.checkpoint.train_state import capture_optimizer, capture_rng, capture_scaler
from infinity.optim.moment_codes import BLOCK, codes_of, scales_of, moment_format
from infinity.zero.units import TensorClass

__all__ = ["save_checkpoint", "engine_for"]

# Each unit tensor is written in pieces of at most this size (bounds the CUDA -> host staging copy).
_WRITE_CHUNK_BYTES = 64 * 2**20


def engine_for(model, optimizer):
    """The ZeRO engine behind ``model`` / ``optimizer`` (both from one ``infinity.initialize``)."""
    from infinity.initialization import engine_of
    engine = engine_of(model)
    if getattr(optimizer, "engine", None) is not engine:
        raise CheckpointError("the optimizer was not returned by the same infinity.initialize as the model")
    return engine


def save_checkpoint(directory, model, optimizer, *, step: int | None = None, keep_last: int | None = None,
                    client_state: dict | None = None, node_local: bool = False) -> Path:
    """Save a sharded checkpoint to ``directory/step_{step:08d}``; returns that path (on every rank).

    ``step`` defaults to the number of ``optimizer.step()`` calls (applied +
    skipped). ``keep_last``: keep this many complete checkpoints in
    ``directory`` (the new one included), None keeps all. ``client_state``:
    rank 0's JSON-serializable dict of the caller's own state (an LR
    scheduler's ``state_dict()``, the data position), returned by
    :func:`load_checkpoint`. Every rank must call it.

    ``directory`` is one directory every rank sees (a shared file system; rank 0's is used), unless
    ``node_local``: for nodes that share none (DeepSpeed's ``checkpoint.use_node_local_storage``), each
    node's ranks write their own files into their node's directory (its lowest rank's), where that rank
    publishes the same manifest (nodes as the launcher placed them: :mod:`infinity.comm.node_layout`). Every
    node's step directory is renamed into place before any ``latest`` moves on or any old checkpoint is
    pruned, so a failure anywhere leaves every node's previous checkpoint whole.
    """
    engine = engine_for(model, optimizer)
    coll, rank = engine.world_coll, engine.world_rank   # every rank of the mesh (both axes)
    engine.drain_update()   # update_at next_forward: the last step's update is whole before it is saved
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"save_checkpoint: keep_last must be >= 1 or None, got {keep_last}")
    if step is None:
        step = max(optimizer.group_steps) + optimizer.skipped_steps
    if client_state is not None:
        try:
            json.dumps(client_state)
        except (TypeError, ValueError) as e:
            raise TypeError(f"save_checkpoint: client_state must be JSON-serializable (no code is ever loaded "
                            f"from a checkpoint): {e}") from None
    root = Path(directory)
    final = root / step_dir_name(step)
    layout = gather_node_layout(coll) if node_local else None
    # who makes, publishes and prunes a directory: rank 0, or (node-local) each node's lowest rank
    publishers = sorted({layout.leader(r) for r in range(coll.world_size)}) if node_local else [0]
    publisher = rank in publishers
    where = (lambda r: f"rank {r} ({layout.keys[layout.node_of[r]]})") if node_local else (lambda r: f"rank {r}")

    # 1. one temp name for all ranks; rank 0 also refuses to overwrite a published checkpoint
    setup = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            setup = ("error", f"save_checkpoint: {final} already exists; pass another step or remove it") \
                if final.exists() else ("ok", f".tmp-{final.name}-{uuid.uuid4().hex[:12]}")
        except OSError as e:
            setup = ("error", f"save_checkpoint: cannot create {root}: {e.strerror or e}")
    said = coll.all_gather_object((setup, os.path.abspath(root)))
    kind, value = said[0][0]
    if kind == "error":
        raise CheckpointError(value)
    # the directory is rank 0's (node-local: the node's lowest rank's); a rank's own choice may differ, e.g.
    # a default run directory named after its own pid
    chosen = said[layout.leader(rank) if node_local else 0][1]
    if chosen != os.path.abspath(root):
        root = Path(chosen)
        final = root / step_dir_name(step)
    tmp = root / value
    if node_local:   # each node's publisher checks and makes its own node's directory
        problem = _make_node_dir(root, final, tmp) if publisher else None
        problems = [(r, p) for r, p in enumerate(coll.all_gather_object(problem)) if p is not None]
        if problems:
            if publisher and problem is None:
                shutil.rmtree(tmp, ignore_errors=True)
            r, p = problems[0]
            raise CheckpointError(f"save_checkpoint: {where(r)}: {p}")

    # 2. this rank's files
    error, index_entry = None, None
    try:
        index_entry = _write_rank_files(tmp, engine, model, rank, extras_copy=node_local and publisher and rank != 0)
    except Exception as e:  # any failure must reach the exchange below, or the other ranks wait forever
        error = _describe(e, f"writing under {tmp}")

    # 3. all ranks learn every rank's outcome before anything is published
    outcomes = coll.all_gather_object((error, index_entry))
    failed = [(r, err) for r, (err, _) in enumerate(outcomes) if err is not None]
    if failed:
        # every rank: where the directory is not shared, a rank's files sit in a temp directory of its own node
        shutil.rmtree(tmp, ignore_errors=True)
        r, err = failed[0]
        raise CheckpointError(f"save_checkpoint: {where(r)} failed ({err}); nothing was published, the previous "
                              f"checkpoint in {root} is intact")

    # 4. publish: every publisher renames its step directory into place ...
    manifest, result = None, None
    if rank == 0:
        try:
            if not node_local:
                _check_one_directory(tmp, outcomes)
            manifest = _manifest(engine, model, optimizer, step, [entry for _, entry in outcomes])
            manifest["client_state"] = client_state
            if node_local:
                manifest.update(node_local=True, nodes=layout.nodes, extras_copies=publishers)
        except Exception as e:  # reported to every rank below
            result = _describe(e, f"publishing {final}")
    if node_local:   # every node's publisher writes the same manifest
        manifest, result = coll.all_gather_object((manifest, result))[0]
    published = False
    if publisher and result is None:
        try:
            write_json(tmp / "manifest.json", manifest)
            fsync_dir(tmp)
            os.rename(tmp, final)
            published = True
            fsync_dir(root)  # the rename itself must be durable before `latest` names it
        except Exception as e:
            result = _describe(e, f"publishing {final}")
    if publisher and not published:
        shutil.rmtree(tmp, ignore_errors=True)
    failed = [(r, err) for r, err in enumerate(coll.all_gather_object(result)) if err is not None]
    if failed:
        if published:   # another node's failed: this node's step directory alone is no checkpoint
            doomed = root / f".tmp-delete-{final.name}-{uuid.uuid4().hex[:12]}"
            os.rename(final, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)   # a rank's files in a temp directory rank 0 never saw
        r, err = failed[0]
        raise CheckpointError(f"save_checkpoint: {where(r)} failed ({err}); nothing was published, the previous "
                              f"checkpoint in {root} is intact")
    # ... and only then (every node's is in place) moves `latest` on and prunes
    result = None
    if publisher:
        try:
            _write_latest(root, final.name)
            _prune(root, final, keep_last)
        except Exception as e:
            result = _describe(e, f"publishing {final}")
    # 5. nobody returns before every publisher has published (or failed)
    failed = [(r, err) for r, err in enumerate(coll.all_gather_object(result)) if err is not None]
    if failed:
        r, err = failed[0]
        raise CheckpointError(f"save_checkpoint: {final} is complete, but {where(r)} then failed ({err}); "
                              f"{root / 'latest'} may still name the previous checkpoint")
    return final


def _make_node_dir(root: Path, final: Path, tmp: Path) -> str | None:
    """Node-local: this node's ``root`` and temp directory, made here; None, or what went wrong."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if final.exists():
            return f"{final} already exists; pass another step or remove it"
        tmp.mkdir()   # not exist_ok: a node that finds another's means the directories are shared
    except FileExistsError:
        return (f"{tmp} was made by another node: the nodes' directories are one shared file system; save "
                "without node_local (infinity train without --save-node-local)")
    except OSError as e:
        return f"cannot create {tmp}: {e.strerror or e}"
    return None


def _check_one_directory(tmp: Path, outcomes: list) -> None:
    """Every rank's index must be in rank 0's temp directory: ranks that do not share it (nodes without a
    shared file system) would otherwise publish a checkpoint missing their shards."""
    for r, (_, entry) in enumerate(outcomes):
        if not (tmp / entry["index"]).is_file():
            raise CheckpointError(f"rank {r}'s files are not in {tmp} as rank 0 sees it: the ranks do not share this "
                                  "directory (nodes without a shared file system?); save with node_local=True "
                                  "(infinity train --save-node-local), each node into its own directory")


def _write_latest(root: Path, name: str) -> None:
    """``latest`` names the newest checkpoint; replaced by rename, so a reader never sees it half-written."""
    with replaced(root / "latest", "w") as f:
        f.write(name + "\n")
    fsync_dir(root)


def _describe(e: Exception, doing: str) -> str:
    if isinstance(e, CheckpointError):
        return str(e)
    if isinstance(e, OSError):
        return f"{doing}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
    return f"{doing}: {type(e).__name__}: {e}"


def _write_rank_files(tmp: Path, engine, model, rank: int, extras_copy: bool = False) -> dict:
    """This rank's files and its index. ``extras_copy``: also the extras, in this rank's directory (a node-local
    checkpoint's lowest rank of a node other than rank 0's: a node resumes from its own directory alone)."""
    mine = tmp / rank_dir(rank)
    mine.mkdir(parents=True, exist_ok=True)
    files = {}
    # stage 0 keeps the whole state on every rank: dp rank 0 alone writes it (shard_world is 1)
    if engine.shard_rank == engine.rank:
        for unit in engine.units:
            rel = unit_file(rank, unit.index)
            files[rel] = _write_unit(tmp / rel, unit, rank, engine.placement)
    rel = f"{rank_dir(rank)}/state.json"
    files[rel] = write_json(tmp / rel, {"rank": rank, "rng": capture_rng()})
    if extras_copy:
        rel = f"{rank_dir(rank)}/extras.safetensors"
        files[rel] = _write_extras(tmp / rel, engine, model)
    if rank == 0:
        files["extras.safetensors"] = _write_extras(tmp / "extras.safetensors", engine, model)
        hf = getattr(model, "config", None)
        if hf is not None and hasattr(hf, "to_json_string"):  # a transformers model: from_pretrained needs it
            files["hf_config.json"] = write_json(tmp / "hf_config.json", json.loads(hf.to_json_string()))
    fsync_dir(mine)
    rel = f"{rank_dir(rank)}/index.json"
    # written last: a rank's index exists only if every file it lists was written and fsynced
    entry = write_json(tmp / rel, {"rank": rank, "files": files})
    fsync_dir(mine)
    return dict(entry, index=rel)


def _write_unit(path: Path, unit, rank: int, placement) -> dict:
    """One unit shard's states, read through UnitShard.read one class at a time (stored: no write-back).

    A split master (``optimizer.master: remainder``) is saved as the fp32 master it is, joined from the
    parameter and the remainder: the same bytes as the two, and a checkpoint any master format loads.
    The moments are saved in the format they are stored in (bf16 with ``optimizer.moments: bf16``: half
    the bytes; int8: the F8_E4M3 codes, then ``<name>_scale``, one fp32 scale per block); loading widens
    or decodes them exactly, and rounds or encodes them for a run that keeps another format."""
    blocked = moment_format(placement.moments_format).blocked
    specs = []
    for name in SHARD_TENSORS:
        specs.append((name, saved_dtype(placement, name), (unit.shard_numel,)))
        if blocked and name != TensorClass.MASTER.value:   # a shard is whole blocks (units.shard_align_numel)
            specs.append((name + SCALE_SUFFIX, torch.float32, (unit.shard_numel // BLOCK,)))
    writer = TensorFileWriter(path, specs, {"unit": unit.name, "rank": rank})
    try:
        for name in SHARD_TENSORS:
            t = unit.shard.read(TensorClass(name))
            if placement.split_master and name == TensorClass.MASTER.value:
                param = unit.shard.read(TensorClass.PARAM).cpu()   # CUDA-only: the shard's host copy
                t = join_bf16_(param, t.cpu(), torch.empty(t.numel(), dtype=torch.float32))
            if blocked and name != TensorClass.MASTER.value:
                rows = _WRITE_CHUNK_BYTES // BLOCK
                for lo in range(0, t.shape[0], rows):
                    writer.write(codes_of(t[lo:lo + rows]).contiguous().view(-1))
                writer.write(scales_of(t).contiguous().view(-1))
                continue
            dtype = saved_dtype(placement, name)
            chunk = _WRITE_CHUNK_BYTES // 4   # elements
            for lo in range(0, t.numel(), chunk):
                writer.write(t[lo:lo + chunk].to(dtype))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def saved_dtype(placement, name: str) -> torch.dtype:
    """The dtype shard tensor ``name`` is saved in: the master fp32 (a split one joined), each moment as
    the placement stores it (``optimizer.moments``; int8: its codes, float8_e4m3fn)."""
    if name == TensorClass.MASTER.value:
        return torch.float32
    fmt = moment_format(placement.moments_format)
    return torch.float8_e4m3fn if fmt.blocked else fmt.dtype


def extra_state_names(engine, model) -> list:
    """state_dict entries that are not trainable parameters in the units: buffers and frozen parameters."""
    in_units = {id(p) for u in engine.units for p in u.params}
    named = dict(model.named_parameters(remove_duplicate=False))
    return [k for k in model.state_dict(keep_vars=True) if k not in named or id(named[k]) not in in_units]


def _write_extras(path: Path, engine, model) -> dict:
    sd = model.state_dict(keep_vars=True)   # references only: trainable stage-3 params may have no storage
    names = extra_state_names(engine, model)
    tensors = [(n, sd[n].detach()) for n in names]
    writer = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors], {"what": "extras"})
    try:
        for _, t in tensors:
            writer.write(t.reshape(-1))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _manifest(engine, model, optimizer, step: int, rank_entries: list) -> dict:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
        "world_size": len(rank_entries), "stage": engine.stage, "shard_world": engine.shard_world,
        "tensor_parallel": tp_manifest(engine.tp),
        "param_dtype": engine.config.precision.param_dtype,
        "config": engine.config.to_dict(),
        "model_class": type(model).__name__,
        "units": unit_layout(engine.units, model),
        "shard_tensors": list(SHARD_TENSORS),
        "shard_tensor_dtypes": {name: DTYPE_CODES[saved_dtype(engine.placement, name)] for name in SHARD_TENSORS},
        # how the run kept its states (optimizer.master / moments); the master is saved as fp32 values
        "state_formats": {"master": engine.config.optimizer.master, "moments": engine.config.optimizer.moments},
        "state_dict_keys": list(model.state_dict(keep_vars=True)),
        "extras": extra_state_names(engine, model),
        "optimizer": capture_optimizer(optimizer),
        "loss_scaler": capture_scaler(engine.loss_scaler),
        "ranks": rank_entries,
    }


def _prune(root: Path, final: Path, keep_last: int | None) -> None:
    """Drop complete checkpoints beyond ``keep_last`` and temp directories of saves that died."""
    for d in root.iterdir():
        # a killed save leaves its temp directory behind; it was never published, so nothing refers to it
        if d.name.startswith(".tmp-") and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    if keep_last is None:
        return
    steps = sorted((int(m.group(1)), d) for d in root.iterdir()
                   if (m := STEP_DIR_RE.match(d.name)) and (d / "manifest.json").is_file() and d != final)
    for _, d in steps[:max(0, len(steps) - (keep_last - 1))]:
        # rename first: a half-deleted directory must never look like a complete checkpoint
        doomed = root / f".tmp-delete-{d.name}-{uuid.uuid4().hex[:12]}"
        os.rename(d, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
