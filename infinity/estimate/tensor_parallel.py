"""The memory and communication model of ZeRO x tensor parallelism (``infinity estimate --tp N``).

With ``T`` tensor-parallel ways and ``D = world / T`` data-parallel ranks, a
plan splits ``Ψ_split`` of the model's ``Ψ`` parameters ``T`` ways (attention
and MLP matrices) and replicates the rest ``Ψ_rep`` (embeddings, norms, row
biases). Each rank's ZeRO engine then sees ``Ψ_local = Ψ_split / T + Ψ_rep``
parameters and shards them over its ``D`` dp ranks, so per rank at stage 3:
``16 Ψ_local / D`` bytes, which is ``16 Ψ / (T D)`` for the split part.

Communication per step, per mesh axis (elements per rank, the ZeRO paper's
volume: an all-reduce counts twice):

- ``dp`` axis: ZeRO's own, on ``Ψ_local``: 2Ψ_local at stages 0-2, 3Ψ_local -
  Ψ_root,local at stage 3 (:mod:`infinity.estimate`); crosses nodes.
- ``tp`` axis: Megatron's two all-reduces of a ``(tokens, C)`` activation per
  block in forward (after attention, after the MLP) and two in backward (the
  gradients of the two column-split inputs): ``4 L C`` elements per token,
  volume ``8 L C``, in the compute dtype; stays inside a node.
- the clip norm, when clipping: one 1-element all-reduce over the world.

With sequence parallelism (``parallel.sequence``, built-in GPT plan) each
all-reduce becomes a reduce-scatter plus an all-gather (the same volume), and
the plan's boundaries add: the embeddings' gradients all-gathered in backward
(``tokens C + seq C``), the final norm's output all-gathered in forward
(``tokens C``), and the sequence-sharded parameters' gradients summed
(``6 L C + 2 C`` elements all-reduced: two norms and two row biases a block,
and the final norm) — :func:`tp_step_volume` with ``seq_len``.

TP pays when the per-rank state does not fit even at ZeRO-3 over the nodes'
dp ranks, or when the dp axis is slow: it divides state, activations of the
split layers and dp-axis bytes by ``T`` at the price of ``8 L C`` tp-axis
elements per token on links that must be fast (NVLink).
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass

import torch.nn as nn

__all__ = ["TPSplit", "TPEstimate", "split_params", "tp_estimate", "tp_step_volume", "gpt_tp_rows"]


@dataclass(frozen=True)
class TPSplit:
    """How a model's parameters divide under a plan."""

    total: int          # Ψ
    split: int          # Ψ_split: elements of parameters the plan splits T ways
    n_layer: int        # blocks (each: two tp all-reduces in forward, two in backward)
    n_embd: int         # C, the width of the all-reduced activations

    @property
    def replicated(self) -> int:
        return self.total - self.split

    def local(self, tp: int) -> int:
        """Ψ_local: elements one tp rank holds before ZeRO sharding."""
        return self.split // tp + self.replicated


def split_params(model: nn.Module, plan: dict) -> int:
    """Elements of the parameters ``plan`` splits (weights of Colwise / Rowwise layers, Colwise biases);
    no process group needed (a meta model works)."""
    from infinity.parallel.tensor_parallel import Colwise, Rowwise
    n = 0
    for name, mod in model.named_modules():
        styles = [s for pat, s in plan.items() if name and fnmatch.fnmatchcase(name, pat)
                  and isinstance(s, (Colwise, Rowwise))]
        if not styles:
            continue
        n += mod.weight.numel()
        if isinstance(styles[0], Colwise) and getattr(mod, "bias", None) is not None:
            n += mod.bias.numel()
    return n


@dataclass(frozen=True)
class TPEstimate:
    """One row: per-rank model state and per-axis communication per step."""

    label: str
    tp: int
    dp: int
    stage: int
    state_bytes_per_rank: int      # model state at rest (16 B / param, mixed precision)
    dp_volume_elements: int        # ZeRO's collectives on the dp axis, per step
    tp_volume_elements: int        # activation all-reduces on the tp axis, per step

    def to_dict(self) -> dict:
        return asdict(self)


def _zero_state(psi: int, n: int, stage: int) -> int:
    """Mixed-precision bytes per rank for Ψ elements over n dp ranks (ceil-sharded)."""
    shard = -(-psi // n)
    return {0: 16 * psi, 1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[stage]


def tp_step_volume(split: TPSplit, tokens_per_rank: int, seq_len: int | None = None) -> int:
    """tp-axis volume per step (elements; all-reduce counted twice): 8 L C per token; with ``seq_len``,
    sequence parallelism's (see the module doc; exact for the built-in GPT's plan)."""
    L, C = split.n_layer, split.n_embd
    if seq_len is None:
        return 8 * L * C * tokens_per_rank
    all_gather = (4 * L + 2) * tokens_per_rank * C + seq_len * C
    reduce_scatter = 4 * L * tokens_per_rank * C
    return all_gather + reduce_scatter + 2 * (6 * L * C + 2 * C)


def dp_step_volume(psi_local: int, root_local: int, stage: int, reshard_after_forward: bool = True) -> int:
    """dp-axis volume per step on Ψ_local (elements): 2Ψ, or at stage 3 3Ψ - Ψ_root (2Ψ without reshard)."""
    if stage < 3 or not reshard_after_forward:
        return 2 * psi_local
    return 3 * psi_local - root_local


def tp_estimate(split: TPSplit, world_size: int, tp: int, stage: int, tokens_per_rank: int,
                root_numel: int = 0) -> TPEstimate:
    """The row for ``tp`` ways on ``world_size`` ranks at ``stage`` (root_numel: the root unit's Ψ, stage 3)."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"--tp {tp} does not divide --devices {world_size}")
    dp = world_size // tp
    local = split.local(tp)
    return TPEstimate(label=f"ZeRO-{stage} x TP{tp} (dp {dp})", tp=tp, dp=dp, stage=stage,
                      state_bytes_per_rank=_zero_state(local, dp if stage else 1, stage),
                      dp_volume_elements=dp_step_volume(local, root_numel, stage),
                      tp_volume_elements=tp_step_volume(split, tokens_per_rank) if tp > 1 else 0)


def gpt_tp_rows(model_name: str, world_size: int, tp: int, tokens_per_rank: int | None = None) -> list:
    """``infinity estimate --tp``'s rows for a built-in GPT (counted on meta): plain ZeRO-3 on every rank,
    then stages 0-3 at ``tp`` ways; ``tokens_per_rank`` defaults to the model's block size."""
    import torch

    from infinity.models import GPT, gpt_config
    from infinity.parallel.plans import GPT_PLAN
    if tp < 1 or world_size % tp:
        raise ValueError(f"{tp} ways must be >= 1 and divide the {world_size} devices")
    cfg = gpt_config(model_name)
    with torch.device("meta"):
        model = GPT(cfg)
    split = TPSplit(total=sum(p.numel() for p in model.parameters()), split=split_params(model, GPT_PLAN),
                    n_layer=cfg.n_layer, n_embd=cfg.n_embd)
    tokens = tokens_per_rank if tokens_per_rank is not None else cfg.block_size
    rows = [tp_estimate(split, world_size, 1, 3, tokens)]
    rows += [tp_estimate(split, world_size, tp, s, tokens) for s in (0, 1, 2, 3)]
    return [dict(r.to_dict(), tokens_per_rank=tokens, split_params=split.split, params=split.total) for r in rows]
