"""Rank-side cases for tests/zero/test_activation_offload.py (importable by tests/helpers/world.py ranks).

The model's units save, for their backward, tensors of every kind the offload must rebuild exactly: a dense
input, a transposed (permuted, dense) view, a chunk with gaps (kept in memory), a softmax output, a bool mask,
a LayerNorm's small statistics (under the size that moves). Each case trains the same steps twice in one
process, with the saved activations kept and offloaded, and returns both runs' losses and parameters.
"""

from __future__ import annotations

import errno
import gc
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from failure_cases import caught, describe, full_params, mean_over_ranks, rank_world

VOCAB, SEQ, WIDTH, HIDDEN, BLOCKS = 64, 128, 64, 128, 3
BATCH = 4   # global rows; each rank trains on its share


class Out:
    def __init__(self, loss):
        self.loss = loss


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qk = nn.Linear(WIDTH, 2 * WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        h = self.norm(x)
        q, k = self.qk(h).chunk(2, dim=-1)                           # views with gaps: stay in memory
        att = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)   # a permuted view saved; the output saved
        u = self.up(att @ h)
        u = torch.where(u > 0, u, 0.1 * u)                           # a bool mask saved
        return x + self.down(u)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        return Out(F.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1)))


def local_ids(step: int) -> torch.Tensor:
    rank, world = rank_world()
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).chunk(world)[rank]


def config(spec: dict, offload: str, tmp: str) -> dict:
    rank, _ = rank_world()
    path = os.path.join(tmp, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    cfg = {"zero": {"stage": spec["stage"], "activation_checkpointing": spec["ckpt"], "activation_offload": offload},
           "precision": {"param_dtype": "fp32"},
           "optimizer": {"lr": 1e-2, "threads": 1},
           "schedule": {"accum_steps": spec.get("accum", 1)},
           "tiers": {"nvme_path": path, "host_bytes": 64 << 20, "device_bytes": 16 << 20}}
    if spec.get("update_at"):
        cfg["offload"] = {"optimizer": "host"}
        cfg["optimizer"]["update_at"] = spec["update_at"]
    return cfg


def _train(spec: dict, offload: str, tmp: str, out: dict, fail=None) -> dict:
    """``spec["steps"]`` steps; ``fail(model, opt, engine, ids, step, micro)`` may break a micro-step first
    (it returns the error text; the micro-step then runs again from its forward)."""
    import infinity

    torch.manual_seed(0)
    model, opt = infinity.initialize(Net(), config(spec, offload, tmp))
    engine = infinity.engine_of(model)
    out.update(losses=[], pending=[], leftover_keys=[], errors=[])
    try:
        for step in range(spec["steps"]):
            for micro in range(spec.get("accum", 1)):
                ids = local_ids(step * 10 + micro)
                if fail is not None:
                    error = fail(model, opt, engine, ids, step, micro)
                    if error is not None:
                        out["errors"].append(error)
                with (engine.no_sync() if micro + 1 < spec.get("accum", 1) else _nothing()):
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                out["losses"].append(mean_over_ranks(loss))
                del loss
            opt.step()
            opt.zero_grad()
            if engine.activations is not None:
                out["pending"].append(engine.activations.pending())
                out["leftover_keys"].append([k for k in engine.store.keys() if k.startswith("activation/")])
        if engine.activations is not None:
            out["stats"] = dict(engine.activations.stats)
        out["params"] = full_params(model, engine)
    finally:
        engine.close()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def exact_case(spec: dict) -> dict:
    """The same steps with the saved activations kept, then offloaded to ``spec["tier"]``."""
    def run(out):
        _train(spec, "none", os.path.join(spec["tmp"], "keep"), out.setdefault("ref", {}))
        _train(spec, spec["tier"], os.path.join(spec["tmp"], "off"), out.setdefault("got", {}))
        return out
    return caught(run)


def _first_activation_extent(engine) -> tuple:
    store = engine.store
    keys = sorted((k for k in store.keys() if k.startswith("activation/")), key=lambda k: int(k.split("/")[1]))
    extents = store._extents
    return extents.path, extents._table[keys[0]].offset, keys[0]


def failure_case(spec: dict) -> dict:
    """A reference run, then one where step ``spec["fail_at"]``'s first forward meets ``spec["fault"]``:
    "enospc" (the disk full while the saved activations are written) or "corrupt" (a byte of the first
    saved activation flipped on disk before backward reads it). The failed micro-step is dropped
    (zero_grad) and run again; the run must end where the reference does."""
    def fail(model, opt, engine, ids, step, micro):
        if step != spec["fail_at"] or micro:
            return None
        try:
            if spec["fault"] == "enospc":
                engine.store._engine.syscalls.inject("pwritev", errno.ENOSPC, count=1)
                try:
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                finally:
                    engine.store._engine.syscalls.clear()
            else:
                loss = model(input_ids=ids, labels=ids).loss
                engine.activations._settle(wait=True)   # every saved activation is on the disk
                path, offset, key = _first_activation_extent(engine)
                fd = os.open(path, os.O_RDWR)
                try:
                    byte = os.pread(fd, 1, offset + 100)
                    os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset + 100)
                finally:
                    os.close(fd)
                loss.backward()
            return "no error"
        except Exception as e:   # noqa: BLE001 - the error is the result
            return describe(e).splitlines()[0]
        finally:
            loss = None
            opt.zero_grad()   # the failed micro-step's gradients are dropped; it runs again

    def run(out):
        _train(spec, "none", os.path.join(spec["tmp"], "keep"), out.setdefault("ref", {}))
        _train(spec, "nvme", os.path.join(spec["tmp"], "off"), out.setdefault("got", {}), fail=fail)
        return out
    return caught(run)


def abandoned_forward_case(spec: dict) -> dict:
    """Forwards under grad whose outputs are dropped without a backward (stage 3, recompute off: every
    saved tensor worth moving goes to NVMe)."""
    import infinity

    def run(out):
        torch.manual_seed(0)
        model, opt = infinity.initialize(Net(), config(dict(stage=3, ckpt=False), "nvme", spec["tmp"]))
        engine = infinity.engine_of(model)
        try:
            for step in range(2):
                loss = model(input_ids=local_ids(step), labels=local_ids(step)).loss
                out["pending_before"] = engine.activations.pending()
                del loss
            gc.collect()   # an abandoned forward's graph is collected as garbage (with or without offload)
            out["pending_after"] = engine.activations.pending()
            out["keys_after"] = [k for k in engine.store.keys() if k.startswith("activation/")]
            out["saved_bytes"] = engine.activations.stats["saved_bytes"]
        finally:
            engine.close()
        return out
    return caught(run)


def resume_case(spec: dict) -> dict:
    """Three steps with the activations on NVMe, a checkpoint after the second; a fresh engine loads it and
    runs the third. Both third steps, and a run keeping the activations, must agree bitwise."""
    import infinity

    def engine_for(offload, tmp):
        torch.manual_seed(0)
        model, opt = infinity.initialize(Net(), config(dict(stage=3, ckpt=True), offload, tmp))
        return model, opt, infinity.engine_of(model)

    def step(model, opt, i):
        ids = local_ids(i)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return mean_over_ranks(loss)

    def run(out):
        ckpt = os.path.join(spec["tmp"], "ckpt")
        for name, offload in (("keep", "none"), ("off", "nvme")):
            model, opt, engine = engine_for(offload, os.path.join(spec["tmp"], name))
            try:
                losses = [step(model, opt, i) for i in range(2)]
                if name == "off":
                    infinity.save_checkpoint(ckpt, model, opt)
                losses.append(step(model, opt, 2))
                out[name] = {"losses": losses, "params": full_params(model, engine)}
            finally:
                engine.close()
        model, opt, engine = engine_for("nvme", os.path.join(spec["tmp"], "resumed"))
        try:
            infinity.load_checkpoint(ckpt, model, opt)
            out["resumed"] = {"losses": [step(model, opt, 2)], "params": full_params(model, engine)}
        finally:
            engine.close()
        return out
    return caught(run)
