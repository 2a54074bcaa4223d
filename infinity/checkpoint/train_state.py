"""The small state beside the shards: RNG streams, optimizer hyper-parameters and steps, loss scaler.

Everything here is JSON (no pickle), so loading it runs no code. RNG states
are per rank (each rank's dropout stream is its own); the rest is the same on
every rank and lives in the manifest.
"""

from __future__ import annotations

import random

import torch

from infinity.checkpoint.tensor_file import CheckpointError

__all__ = ["capture_rng", "restore_rng", "capture_optimizer", "restore_optimizer", "capture_scaler",
           "restore_scaler"]


def capture_rng() -> dict:
    version, state, gauss = random.getstate()
    out = {"torch": torch.get_rng_state().numpy().tobytes().hex(),
           "python": {"version": version, "state": list(state), "gauss": gauss},
           "numpy": None, "cuda": None}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached": float(cached)}
    except ImportError:
        pass
    if torch.cuda.is_available():  # CUDA-only: one generator state per visible device
        out["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict, where: str) -> None:
    try:
        torch.set_rng_state(torch.frombuffer(bytearray.fromhex(state["torch"]), dtype=torch.uint8))
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        if state.get("numpy") is not None:
            import numpy as np
            n = state["numpy"]
            np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                                 n["cached"]))
        if state.get("cuda") is not None and torch.cuda.is_available():  # CUDA-only
            states = [torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8) for h in state["cuda"]]
            torch.cuda.set_rng_state_all(states[:torch.cuda.device_count()])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{where}: RNG state is malformed ({type(e).__name__}: {e})") from None


def capture_optimizer(optimizer) -> dict:
    """Each group's hyper-parameters (everything but its params), the per-group step counts and skips."""
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"})
    return {"param_groups": groups, "group_steps": list(optimizer.group_steps),
            "skipped_steps": optimizer.skipped_steps}


def restore_optimizer(optimizer, saved: dict, where: str) -> None:
    """As ``torch.optim.Optimizer.load_state_dict``: the saved hyper-parameters replace the current ones."""
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{where}: saved {len(groups)} param groups, the optimizer has "
                              f"{len(optimizer.param_groups)}")
    for g, s in zip(optimizer.param_groups, groups):
        for k, v in s.items():
            g[k] = tuple(v) if k == "betas" else v
    optimizer.group_steps = [int(x) for x in saved["group_steps"]]
    optimizer.skipped_steps = int(saved["skipped_steps"])


def capture_scaler(scaler) -> dict | None:
    return None if scaler is None else scaler.state_dict()


def restore_scaler(scaler, saved: dict | None, where: str) -> None:
    # a precision change (fp16 <-> bf16/fp32) keeps the current scaler or has none to fill
    if saved is None or scaler is None:
        return
    scaler.scale = float(saved["scale"])
    scaler.good_steps = int(saved["good_steps"])
    scaler.skipped_steps = int(saved["skipped_steps"])
