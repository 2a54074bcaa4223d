"""Rank-side cases for tests/checkpoint/test_node_local.py: ranks of one machine told they are on other nodes.

``GROUP_RANK`` is what torchrun tells a rank about its node (:mod:`infinity.comm.node_layout`); setting
it per rank makes a world of 2 on one machine two "nodes" of one rank each, with a directory each.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from checkpoint_cases import build, train


def _as_node(node: int):
    before = os.environ.get("GROUP_RANK")
    os.environ["GROUP_RANK"] = str(node)
    return before


def _restore(before) -> None:
    if before is None:
        os.environ.pop("GROUP_RANK", None)
    else:
        os.environ["GROUP_RANK"] = before


def save_case(spec: dict, dirs: list, shared: bool = False) -> dict:
    """Train ``save_at`` steps, save node-local (rank r into ``dirs[r]``, or all into ``dirs[0]`` when
    ``shared``), train on to ``steps``; the losses after the save, or the save's error."""
    from infinity.checkpoint import save_checkpoint

    rank = dist.get_rank()
    before = _as_node(rank)
    try:
        model, opt, engine = build(spec)
        train(model, opt, spec, 0, spec["save_at"])
        try:
            path = save_checkpoint(dirs[0 if shared else rank], model, opt, node_local=True)
        except Exception as e:  # noqa: BLE001 - the message is the result
            engine.close()
            return {"error": f"{type(e).__name__}: {e}"}
        losses = train(model, opt, spec, spec["save_at"], spec["steps"])
        engine.close()
        return {"path": str(path), "losses": losses}
    finally:
        _restore(before)


def load_case(spec: dict, checkpoint, own: bool = False) -> dict:
    """A model from another seed loads ``checkpoint`` (``own``: a list, rank r passing only its item r) and
    trains from ``save_at`` to ``steps``; the losses."""
    from infinity.checkpoint import load_checkpoint

    if own:
        checkpoint = checkpoint[dist.get_rank()]
    model, opt, engine = build(spec, seed=123)
    info = load_checkpoint(checkpoint, model, opt)
    losses = train(model, opt, spec, spec["save_at"], spec["steps"])
    engine.close()
    return {"losses": losses, "step": info["step"]}
