"""``load_checkpoint``: fill this rank's shards from a checkpoint saved at any world size and stage.

Resharding is arithmetic on the unpadded flat buffer of each unit: this rank
owns elements ``[shard_rank * shard_numel, ...)`` of it now; the saved rank
``r`` held ``[r * saved_shard_numel, ...)``. Each piece of the overlap is
``pread`` straight into this rank's shard tensor (obtained through
``UnitShard.get``, one unit at a time), and padding is zeroed. The unit
layout (names, shapes, offsets, groups) must match; padding, shard sizes,
world size and stage may differ. Stage 0 saves the full state once (rank 0);
loading at stage 0 reads every unit whole on every rank. Tensor parallelism:
at the same ``parallel.tensor`` each ``tp`` rank reads its own slices the same
way; at another, parameters are reassembled and re-split one at a time
(:mod:`infinity.checkpoint.tp_layout`).

Every file this rank will read is checksum-verified first, and all ranks agree
on success before the first collective, so a corrupt or missing file is one
clear error on every rank instead of a hang.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.checkpoint.manifest import SHARD_TENSORS, Checkpoint, unit_layout
from infinity.checkpoint.save import engine_for
from infinity.checkpoint.shard_reader import ShardReader
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader
from infinity.checkpoint.tp_layout import check_full_layout, load_unit_resharded
from infinity.checkpoint.train_state import restore_optimizer, restore_rng, restore_scaler
from infinity.optim.cpu_adam import write_param_
from infinity.optim.moment_codes import encode_
from infinity.optim.split_master import split_bf16_
from infinity.zero.units import TensorClass, UnitState

__all__ = ["load_checkpoint"]


def load_checkpoint(directory, model, optimizer, *, load_rng: bool = True) -> dict:
    """Load ``directory`` (a step directory, or a root holding ``latest`` / ``step_*``) into model and optimizer.

    A node-local checkpoint: each rank passes its own node's directory (it reads only the files it needs,
    which on the same nodes and world size are its own node's), or a list of every node's directory.

    Every rank must call it. Returns ``{"path", "step", "saved_world_size", "saved_stage", "client_state"}``.
    RNG states: rank r gets saved rank r's (when the saved world had a rank r).
    """
    engine = engine_for(model, optimizer)
    coll, rank = engine.world_coll, engine.world_rank   # every rank of the mesh (both axes)
    error, rng_path, resplit = None, None, False
    try:
        ckpt = Checkpoint(directory)
        tp_size, tp_rank = (engine.tp.size, engine.tp.rank) if engine.tp is not None else (1, 0)
        resplit = ckpt.tp_size != tp_size
        if resplit:
            check_full_layout(ckpt, unit_layout(engine.units, model), engine.tp, len(optimizer.param_groups))
        else:
            ckpt.check_layout(unit_layout(engine.units, model), len(optimizer.param_groups))
        reader = ShardReader(ckpt)
        # verify everything this rank will read before any collective; CRC-32 runs at a few GB/s on one
        # core (zlib releases the GIL), so the files are checked on io.threads threads
        if resplit:   # parameters are reassembled from every saved tp rank's slices
            needed = {rel: r for i, u in enumerate(ckpt.units) for t in range(ckpt.tp_size)
                      for r, rel in reader.files_for(i, 0, int(u["numel"]), t)}
        else:
            needed = {rel: r for unit in engine.units
                      for r, rel in reader.files_for(unit.index, *_owned(engine, unit), tp_rank)}
        with ThreadPoolExecutor(max_workers=engine.config.io.threads) as pool:
            list(pool.map(lambda item: ckpt.verify(item[0], item[1], ckpt.saved_tensors()), needed.items()))
        if ckpt.manifest["extras"]:
            ckpt.verify(*ckpt.extras_source())
        if load_rng and rank < ckpt.world_size:
            rng_path = ckpt.verify(f"rank{rank:05d}/state.json", rank)
    except Exception as e:  # every rank must reach the exchange below, or the others wait forever
        error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    outcomes = coll.all_gather_object((error, None if error is not None else ckpt.manifest["step"]))
    if error is not None:
        raise CheckpointError(error)
    failed = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
    if failed:
        raise CheckpointError(f"load_checkpoint failed on rank {failed[0][0]}: {failed[0][1]}")
    # node-local directories are found per node: one node's latest may name another step than another's
    steps = sorted({step for _, step in outcomes})
    if len(steps) > 1:
        by_rank = ", ".join(f"rank {r}: step {step}" for r, (_, step) in enumerate(outcomes))
        raise CheckpointError(f"load_checkpoint: the ranks found different checkpoints ({by_rank}); give every "
                              "node the same step directory")

    engine.prepare_load()   # whatever the step was doing (a backward that raised, a failed update) is dropped
    try:
        for unit in engine.units:
            _load_unit(engine, unit, reader, ckpt if resplit else None)
            reader.close_unit(unit.index)
    finally:
        reader.close()
    _load_extras(ckpt, model)
    where = f"checkpoint {ckpt.dir}"
    restore_optimizer(optimizer, ckpt.manifest["optimizer"], where)
    restore_scaler(engine.loss_scaler, ckpt.manifest.get("loss_scaler"), where)
    if rng_path is not None:
        try:
            rng = json.loads(rng_path.read_bytes())["rng"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{rng_path} (rank {rank}): not a rank state file ({e})") from None
        restore_rng(rng, f"{rng_path} (rank {rank})")
    engine.zero_grad()  # gradients from before the load belong to other weights
    return {"path": str(ckpt.dir), "step": ckpt.manifest["step"], "saved_world_size": ckpt.world_size,
            "saved_stage": ckpt.manifest["stage"], "client_state": ckpt.manifest.get("client_state")}


def _owned(engine, unit) -> tuple:
    """This rank's element range of the unpadded flat buffer (may be empty: a shard of pure padding)."""
    lo = min(engine.shard_rank * unit.shard_numel, unit.numel)
    return lo, min(lo + unit.shard_numel, unit.numel)


def _load_unit(engine, unit, reader: ShardReader, resplit_from=None) -> None:
    """This rank's shard of ``unit``; ``resplit_from``: the checkpoint, saved at other tensor-parallel ways."""
    if engine.policy.shard_params and unit.state is not UnitState.SHARDED:
        engine.gathers.release(unit)  # a gathered full buffer would go stale once the shard changes
    lo, hi = _owned(engine, unit)
    shard = unit.shard
    tp_rank = engine.tp.rank if engine.tp is not None else 0
    rebuilt = load_unit_resharded(engine, unit, reader, resplit_from, SHARD_TENSORS, lo, hi) \
        if resplit_from is not None else None
    split = engine.placement.split_master
    for name in SHARD_TENSORS:
        t = shard.get(TensorClass(name))
        # a split master is read as the fp32 master it stands for, then split below
        fp32 = split and name == TensorClass.MASTER.value
        # read as fp32 (bf16-saved moments widened exactly, int8-saved ones decoded); one kept bf16 is then
        # rounded by the copy (exact for a bf16-saved one), one kept int8 encoded (the same values for an
        # int8-saved one: moment_codes)
        staging = t if t.device.type == "cpu" and not fp32 and t.dtype == torch.float32 else \
            torch.empty(unit.shard_numel, dtype=torch.float32)  # CUDA-only staging, the fp32 master or a moment
        with torch.no_grad():
            if rebuilt is not None:
                staging[:hi - lo].copy_(rebuilt[name])
            else:
                reader.read(unit.index, name, lo, hi, staging[:hi - lo], tp_rank=tp_rank)
            staging[hi - lo:].zero_()  # padding is in no param group: it must stay zero
            if fp32:
                master32 = staging
            elif t.dtype == torch.uint8:   # int8 moments: rows of blocks
                rows = t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype)   # CUDA-only staging
                encode_(staging, rows, root=name == TensorClass.EXP_AVG_SQ.value)
                if rows is not t:
                    t.copy_(rows)
            elif staging is not t:
                t.copy_(staging)
    master, param = shard.get(TensorClass.MASTER), shard.get(TensorClass.PARAM)
    with torch.no_grad():
        if split:   # the parameter and the remainder, from the fp32 master exactly (whatever format saved it)
            param_host = torch.empty(param.numel(), dtype=param.dtype)
            remainder = torch.empty(master.numel(), dtype=master.dtype)
            split_bf16_(master32, param_host, remainder)
            param.copy_(param_host)
            master.copy_(remainder)
        elif param is not master:
            # the compute-dtype shard is always the master rounded (as after a step)
            write_param_(master, param)
        if engine.policy.gather_after_step:
            # parameters are views of the full buffer: every rank's new shard must reach every rank
            engine.refresh_full_param(unit)


def _load_extras(ckpt: Checkpoint, model) -> None:
    names = ckpt.manifest["extras"]
    if not names:
        return
    sd = model.state_dict(keep_vars=True)
    missing = [n for n in names if n not in sd]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.dir}: saved state {missing[0]!r} (a buffer or frozen parameter) "
                              f"is not in {type(model).__name__}'s state_dict")
    rel, rank = ckpt.extras_source()
    with TensorFileReader(ckpt.path(rel, rank), f"checkpoint extras (rank {rank})") as f, torch.no_grad():
        for n in names:
            dst = sd[n]
            src = f.read(n)
            if tuple(src.shape) != tuple(dst.shape):
                raise CheckpointError(f"checkpoint {ckpt.dir}: {n!r} has shape {list(src.shape)}, the model's "
                                      f"{list(dst.shape)}")
            dst.copy_(src)
