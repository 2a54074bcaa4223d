"""A GPT-2 style decoder in the nanoGPT mould: the built-in demo model.

Shapes in comments: B batch, T sequence, C = n_embd, H = n_head, V = vocab.

Labels convention: ``labels[b, t]`` is the target for position ``t`` — the
model does NOT shift. Pass ``labels = tokens[1:]`` for ``input_ids =
tokens[:-1]`` (what :mod:`infinity.data` yields). Positions with label -100
are ignored. ``loss`` is the mean cross-entropy over the non-ignored targets.

Initialization lives in :func:`gpt_init_`, which sets the parameters of any
module of this file (a whole GPT, one Block, an Embedding ...) from the config
alone, so a model built on the meta device can be materialized and initialized
one unit at a time. Init order decides the random values, so: under the same
``torch.manual_seed``, calling ``gpt_init_`` on ``wte``, ``wpe``, ``ln_f``
and then each block in order gives exactly the values ``GPT(cfg)`` gives
(``ln_f`` draws no random numbers, ``lm_head`` shares ``wte``'s weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig", "GPTOutput", "Block", "CausalSelfAttention", "MLP", "gpt_config",
           "gpt_init_", "GPT_SIZES"]


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    vocab_size: int = 256      # byte-level: every uint8 is a token, nothing to download
    block_size: int = 64       # longest sequence (rows of the position embedding)
    bias: bool = True          # biases in Linear and LayerNorm, as GPT-2

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig.{name}: expected a positive integer, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd {self.n_embd} is not divisible by n_head {self.n_head}")


# Byte-level vocab (256) throughout. With so small a vocab the embeddings are
# tiny, so the layer/width are chosen from the GPT-2/GPT-3 paper shapes and then
# adjusted until the count in the name holds (checked to +-15% in tests):
#   125m: GPT-3 Small width 768, 18 layers instead of 12  -> ~128M
#   350m: GPT-3 Medium width 1024, 28 layers instead of 24 -> ~353M
#   1b:   GPT-3 XL width 2048, 20 layers instead of 24    -> ~1.01B
#   3b:   GPT-3 2.7B width 2560, 38 layers instead of 32  -> ~2.99B
GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64),
    "125m": GPTConfig(n_layer=18, n_head=12, n_embd=768, vocab_size=256, block_size=1024),
    "350m": GPTConfig(n_layer=28, n_head=16, n_embd=1024, vocab_size=256, block_size=1024),
    "1b": GPTConfig(n_layer=20, n_head=16, n_embd=2048, vocab_size=256, block_size=2048),
    "3b": GPTConfig(n_layer=38, n_head=32, n_embd=2560, vocab_size=256, block_size=2048),
}


def gpt_config(name: str) -> GPTConfig:
    """The built-in shape called ``name`` (tiny, 125m, 350m, 1b, 3b)."""
    try:
        return GPT_SIZES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown GPT size {name!r}; valid names: {', '.join(GPT_SIZES)}") from None


@dataclass
class GPTOutput:
    logits: torch.Tensor            # (B, T, V)
    loss: torch.Tensor | None       # scalar, or None without labels


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)   # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)       # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # q, k, v: (B, T, C) each. Under tensor parallelism c_attn is column-split and n_head is this
        # rank's heads, so they are (B, T, C / tp) with the head size unchanged; under sequence
        # parallelism x holds T / tp positions and c_attn gathers all T: shapes come from its output
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (t.unflatten(2, (self.n_head, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)   # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block; the unit ZeRO-3 gathers and frees."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        target = torch.get_default_device()
        # Built on meta, then materialized once and initialized by gpt_init_: the
        # modules' own default inits would cost a full pass over the weights and
        # draw random numbers that gpt_init_ overwrites anyway.
        with torch.device("meta"):
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            ))
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.to_empty(device=target)
        # Tie after to_empty: to_empty gives each module its own new Parameter,
        # so a tie made before it would silently come apart.
        self.lm_head.weight = self.transformer.wte.weight
        gpt_init_(self, cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput:
        B, T = input_ids.shape
        if T > self.config.block_size:
            raise ValueError(f"GPT.forward: sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)    # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))                     # (B, T, V)
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"GPT.forward: labels shape {tuple(labels.shape)} != input_ids shape "
                                 f"{tuple(input_ids.shape)} (labels are already shifted; see module doc)")
            loss = F.cross_entropy(logits.reshape(B * T, -1).float(), labels.reshape(B * T), ignore_index=-100)
        return GPTOutput(logits=logits, loss=loss)


@torch.no_grad()
def gpt_init_(module: nn.Module, cfg: GPTConfig) -> nn.Module:
    """Initialize ``module`` and its descendants in place, GPT-2 style; returns it.

    Linear and Embedding weights ~ N(0, 0.02); the two residual projections
    (``attn.c_proj``, ``mlp.c_proj``) ~ N(0, 0.02 / sqrt(2 * n_layer)) so the
    residual stream's variance does not grow with depth; biases 0; LayerNorm
    weight 1, bias 0. Visits modules in ``module.modules()`` order and each
    parameter once (the tied ``lm_head.weight`` is left to ``wte``). Pass a
    Block or larger to get the residual scaling: a bare ``c_proj`` Linear
    cannot know it is one. Meta parameters are no-ops.
    """
    std = 0.02
    proj_std = std / math.sqrt(2 * cfg.n_layer)
    residual = {id(m.c_proj) for m in module.modules() if isinstance(m, (CausalSelfAttention, MLP))}
    seen: set[int] = set()

    def fresh(p: torch.Tensor | None) -> bool:
        if p is None or id(p) in seen:
            return False
        seen.add(id(p))
        return True

    for m in module.modules():
        if isinstance(m, nn.Linear):
            if fresh(m.weight):
                nn.init.normal_(m.weight, mean=0.0, std=proj_std if id(m) in residual else std)
            if fresh(m.bias):
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            if fresh(m.weight):
                nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, nn.LayerNorm):
            if fresh(m.weight):
                nn.init.ones_(m.weight)
            if fresh(m.bias):
                nn.init.zeros_(m.bias)
    return module
