"""Run by torchrun on each of two nodes (tests/test_two_nodes.py): the cases of the JSON file ``argv[1]``.

Each case runs on every rank; each rank writes what it returned to
``$INFINITY_NODE_DIR/results/<case>-rank<r>.pt`` (its own node's directory),
and an exception is recorded there as ``{"error": "..."}`` so one failing case
does not hide the others. Swap files and checkpoints go under the node's own
directory: no path is shared between the nodes.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import offload_cases
import tp_cases
import zero_cases
import zeropp_cases
from zero_cases import backward_on_share, build_model, global_batch



def node_dir() -> Path:
    """This node's own directory (the harness sets it per node)."""
    return Path(os.environ["INFINITY_NODE_DIR"])


def _node() -> dict:
    return {"group_rank": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"])}


def _train(spec: dict, cfg: dict, save_dir: str | None = None) -> dict:
    """Train the spec on this rank's share of each global batch; rank 0 returns the full parameters.
    ``save_dir``: a node-local checkpoint after ``spec["save_at"]`` steps."""
    import infinity

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(spec["model"], spec.get("seed", 0))
    model, opt = infinity.initialize(model, cfg)
    engine = infinity.engine_of(model)
    losses, saved, swap_files = [], None, []
    for step in range(spec["steps"]):
        losses.append(backward_on_share(model, global_batch(step, spec["batch"]), rank, world))
        opt.step()
        opt.zero_grad()
        if step == 0 and engine.store is not None:   # the swap files this rank has open now, on its node's disk
            swap_files = sorted(str(p) for p in Path(cfg["tiers"]["nvme_path"]).rglob("*") if p.is_file())
        if save_dir is not None and step + 1 == spec["save_at"]:
            saved = str(infinity.save_checkpoint(save_dir, model, opt, node_local=True))
    with engine.gathered():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
    pp = engine.unit_comm
    out = {"losses": losses, "norms": [], "params": params, "node": _node(), "swap_files": swap_files,
           "saved": saved, "ranks_per_node": getattr(pp, "ranks_per_node", None),
           "node_group": pp.intra.members if getattr(pp, "intra", None) is not None else None,
           "cross_node_bytes": engine.coll.counters.snapshot()["cross_node_bytes"]}
    engine.close()
    return out


def nvme_case(spec: dict) -> dict:
    """Stage 3, parameters and optimizer states on NVMe in this node's own swap directory."""
    spec = dict(spec, tmp=str(node_dir() / "swap"))
    return _train(spec, offload_cases.offload_config(spec, dist.get_rank(), dist.get_world_size()))


def hpz_case(spec: dict) -> dict:
    """ZeRO++ hpZ with ``ranks_per_node`` as the spec says (auto: from the launcher)."""
    return _train(spec, zeropp_cases.config_for(spec))


def tp_case(spec: dict) -> dict:
    """ZeRO x tensor parallelism, tp within a node (torchrun's consecutive ranks)."""
    return tp_cases.train_tp_case(spec)


def checkpoint_case(spec: dict) -> dict:
    """Stage 3 on NVMe, a node-local checkpoint into this node's directory after ``save_at`` steps."""
    spec = dict(spec, tmp=str(node_dir() / "swap"))
    cfg = offload_cases.offload_config(spec, dist.get_rank(), dist.get_world_size())
    return _train(spec, cfg, save_dir=str(node_dir() / "ckpt"))


def resume_case(spec: dict, checkpoint, swap_root: str) -> dict:
    """Another world (or layout) loads ``checkpoint`` (a directory, or every node's) into a model built from
    another seed and trains steps ``save_at`` to ``steps``; the losses (averaged over ranks)."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    spec = dict(spec, tmp=swap_root)
    model = build_model(spec["model"], seed=123)   # everything must come from the checkpoint
    model, opt = infinity.initialize(model, offload_cases.offload_config(spec, rank, world))
    engine = infinity.engine_of(model)
    info = infinity.load_checkpoint(checkpoint, model, opt)
    losses = []
    for step in range(spec["save_at"], spec["steps"]):
        losses.append(backward_on_share(model, global_batch(step, spec["batch"]), rank, world))
        opt.step()
        opt.zero_grad()
    engine.close()
    return {"losses": losses, "step": info["step"], "saved_world_size": info["saved_world_size"]}


def resume_on_nodes_case(spec: dict) -> dict:
    """Run by torchrun on each node: ``resume_case`` from ``spec["checkpoint"]`` (every node's directory)."""
    return resume_case(spec, spec["checkpoint"], str(node_dir() / "swap-resume"))


def error_case(spec: dict) -> dict:
    """Build the spec's ZeRO++ config; the error it raises, if any."""
    import infinity
    try:
        infinity.initialize(build_model(spec["model"]), zeropp_cases.config_for(spec))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error_message": f"{type(e).__name__}: {e}"}
    return {"error_message": None}


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out_dir = node_dir() / "results"
    out_dir.mkdir(exist_ok=True)
    for case in cases:
        try:
            result = globals()[case["kind"] + "_case"](case["spec"])
        except Exception:  # noqa: BLE001 - recorded for the test; the other cases still run
            result = {"error": traceback.format_exc()}
            dist.barrier()   # a failure on every rank alike keeps them in step; a lone one ends the job here
        torch.save(result, out_dir / f"{case['name']}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
