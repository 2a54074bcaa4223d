"""Default tensor-parallel plans: the built-in GPT, Hugging Face GPT-2 and Llama.

Each is the Megatron layout of a transformer block: attention's q/k/v
projections and the MLP's first layer(s) column-split, the attention output
and the MLP's last layer row-split, so one block costs one all-reduce after
attention and one after the MLP in forward (and their mirror images in
backward), and every rank holds whole heads. Embeddings, norms and the output
head stay replicated (a vocabulary-parallel head is not planned). Pass your
own dict to ``infinity.initialize(..., tp_plan=...)`` for any other model.
"""

from __future__ import annotations

import torch.nn as nn

from infinity.parallel.sequence_parallel import GatherOutput, ScatterOutput, SequenceParallel
from infinity.parallel.tensor_parallel import Colwise, DivideAttrs, Rowwise

__all__ = ["default_plan", "GPT_PLAN", "GPT_SEQUENCE_PLAN", "GPT2_PLAN", "LLAMA_PLAN"]

# infinity.models.GPT: fused q|k|v in c_attn (3 blocks), local head count n_head
GPT_PLAN = {
    "transformer.h.*.attn": DivideAttrs("n_head"),
    "transformer.h.*.attn.c_attn": Colwise(parts=3),
    "transformer.h.*.attn.c_proj": Rowwise(),
    "transformer.h.*.mlp.c_fc": Colwise(),
    "transformer.h.*.mlp.c_proj": Rowwise(),
}

# the same with sequence parallelism: embeddings' outputs sliced along the sequence (B, T, C) / (T, C), the
# norms and residual stream on 1/T of it, gathered again after ln_f for the replicated head
GPT_SEQUENCE_PLAN = {
    "transformer.wte": ScatterOutput(1),
    "transformer.wpe": ScatterOutput(0),
    "transformer.h.*.ln_[12]": SequenceParallel(),
    "transformer.ln_f": (SequenceParallel(), GatherOutput(1)),
    "transformer.h.*.attn": DivideAttrs("n_head"),
    "transformer.h.*.attn.c_attn": Colwise(parts=3, sequence_dim=1),
    "transformer.h.*.attn.c_proj": Rowwise(sequence_dim=1),
    "transformer.h.*.mlp.c_fc": Colwise(sequence_dim=1),
    "transformer.h.*.mlp.c_proj": Rowwise(sequence_dim=1),
}

# transformers GPT2LMHeadModel: Conv1D layers, q|k|v split by split_size (heads are inferred with -1)
GPT2_PLAN = {
    "transformer.h.*.attn": DivideAttrs("split_size", "num_heads"),
    "transformer.h.*.attn.c_attn": Colwise(parts=3),
    "transformer.h.*.attn.c_proj": Rowwise(),
    "transformer.h.*.mlp.c_fc": Colwise(),
    "transformer.h.*.mlp.c_proj": Rowwise(),
}

# transformers LlamaForCausalLM: separate q/k/v (heads inferred with -1), gated MLP
LLAMA_PLAN = {
    "model.layers.*.self_attn.q_proj": Colwise(),
    "model.layers.*.self_attn.k_proj": Colwise(),
    "model.layers.*.self_attn.v_proj": Colwise(),
    "model.layers.*.self_attn.o_proj": Rowwise(),
    "model.layers.*.mlp.gate_proj": Colwise(),
    "model.layers.*.mlp.up_proj": Colwise(),
    "model.layers.*.mlp.down_proj": Rowwise(),
}

_BY_CLASS = {"GPT": GPT_PLAN, "GPT2LMHeadModel": GPT2_PLAN, "LlamaForCausalLM": LLAMA_PLAN}
_SEQUENCE_BY_CLASS = {"GPT": GPT_SEQUENCE_PLAN}


def default_plan(model: nn.Module, sequence_parallel: bool = False) -> dict:
    """The plan for ``model``'s class; raises naming the known classes and how to pass a plan otherwise."""
    plans = _SEQUENCE_BY_CLASS if sequence_parallel else _BY_CLASS
    plan = plans.get(type(model).__name__)
    if plan is not None:
        return dict(plan)
    if sequence_parallel:
        raise ValueError(f"parallel.sequence: no default sequence-parallel plan for {type(model).__name__} "
                         f"(known: {', '.join(plans)}); pass tp_plan=... with ScatterOutput / "
                         "GatherOutput / SequenceParallel (infinity.parallel.sequence_parallel), or set it false")
    raise ValueError(f"parallel.tensor > 1: no default tensor-parallel plan for {type(model).__name__} (known: "
                     f"{', '.join(plans)}); pass infinity.initialize(..., tp_plan={{pattern: Colwise() | "
                     "Rowwise() | DivideAttrs(...)}}) (see infinity.parallel.tensor_parallel)")
