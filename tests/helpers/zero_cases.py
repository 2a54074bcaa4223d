"""Models, data and rank-side case functions shared by the tests/zero/test_*.py files.

Everything here is importable by the spawned ranks of :mod:`world` (top-level
functions, picklable arguments) and by the pytest process, which computes the
single-process ``torch.optim.AdamW`` reference with the same builders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

SEQ = 16
VOCAB = 128


# ---------------------------------------------------------------- models

@dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor


class TiedBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class CrossTied(nn.Module):
    """Embedding tied to the output head, and block 0's weight tied to block 2's (across units)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(TiedBlock(width) for _ in range(3))
        self.blocks[2].fc.weight = self.blocks[0].fc.weight
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids, labels=None):
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))
        return Out(loss, logits)


def build_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        from infinity.models import GPT, GPTConfig
        return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ))
    if kind == "cross_tied":
        return CrossTied()
    if kind == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg)
    if kind == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                          attn_implementation="eager")
        return LlamaForCausalLM(cfg)
    raise ValueError(f"unknown test model {kind!r}")


def global_batch(step: int, batch: int, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + step)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def param_groups(model: nn.Module, spec: dict):
    """None, or the usual two groups: decay on matrices, none on biases and norm weights (own lr too)."""
    if not spec.get("groups"):
        return None
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": spec["lr"] * 0.5}]


def make_scheduler(opt, spec: dict):
    if not spec.get("scheduler"):
        return None
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


# ---------------------------------------------------------------- the reference

def reference_run(spec: dict, build=None, before_step=None) -> dict:
    """Plain single-process fp32 torch.optim.AdamW over the full global batch.

    ``build(kind, seed)`` makes the model (default :func:`build_model`);
    ``before_step(model, step)`` runs before each step (e.g. to set a data-dependent route).
    """
    torch.set_num_threads(1)
    model = (build or build_model)(spec["model"], spec.get("seed", 0))
    groups = param_groups(model, spec)
    opt = torch.optim.AdamW(groups if groups else model.parameters(), lr=spec["lr"], betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.1)
    sched = make_scheduler(opt, spec)
    init = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    losses, norms = [], []
    for step in range(spec["steps"]):
        if before_step is not None:
            before_step(model, step)
        ids = global_batch(step, spec["batch"])
        loss = _loss(model, ids)
        loss.backward()
        losses.append(loss.item())
        if spec.get("clip"):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"]).item())
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return {"losses": losses, "norms": norms, "init": init,
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


# ---------------------------------------------------------------- rank side

def config_for(spec: dict) -> dict:
    return {
        "zero": {"stage": spec["stage"], "reshard_after_forward": spec.get("reshard", True),
                 "bucket_bytes": spec.get("bucket_bytes", 16 * 1024),
                 "activation_checkpointing": spec.get("checkpointing", False)},
        "precision": {"param_dtype": spec.get("dtype", "fp32"), "reduce_dtype": spec.get("reduce", "fp32")},
        # spec["optimizer"]: further optimizer keys (stored formats, overlap_backward)
        "optimizer": {"lr": spec["lr"], "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                      **spec.get("optimizer", {})},
    }


def backward_on_share(model, global_ids: torch.Tensor, rank: int, world: int, accum: int = 1) -> float:
    """Forward/backward this rank's micro-batches of a global batch; returns the loss averaged over all ranks.

    Micro-batch j of rank r is global chunk r * accum + j, so the ranks together see
    exactly the global batch the single-process reference trains on.
    """
    micro = global_ids.chunk(world * accum)
    total = torch.zeros(())
    for j in range(accum):
        loss = _loss(model, micro[rank * accum + j])
        (loss / accum).backward()
        total += loss.detach().float() / accum
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= world
    return total.item()


def train_case(spec: dict) -> dict:
    """Train with infinity on this rank's share of each global batch; rank 0 returns the full params."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = build_model(spec["model"], spec.get("seed", 0))
    model, opt = infinity.initialize(model, config_for(spec), params=param_groups(model, spec))
    engine = infinity.engine_of(model)
    sched = make_scheduler(opt, spec)
    accum = spec.get("accum", 1)
    losses, norms, stats = [], [], []
    for step in range(spec["steps"]):
        losses.append(backward_on_share(model, global_batch(step, spec["batch"]), rank, world, accum))
        if spec.get("clip"):
            norms.append(float(opt.clip_grad_norm_(spec["clip"])))
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        stats.append(engine.stats.last_step)
    with engine.gathered():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
    return {"losses": losses, "norms": norms, "params": params, "stats": stats,
            "lr": [g["lr"] for g in opt.param_groups]}


def update_error(got: dict, ref: dict) -> float:
    """||got - ref|| / ||ref - init|| over all parameters: the error relative to how far training moved them."""
    num = sum(((got["params"][n] - p) ** 2).sum() for n, p in ref["params"].items())
    den = sum(((p - ref["init"][n]) ** 2).sum() for n, p in ref["params"].items())
    return float((num / den).sqrt())


def compare(got: dict, ref: dict, loss_rtol: float, param_atol: float | None = None,
            max_update_error: float | None = None) -> None:
    """Per-step loss and final parameters; raises AssertionError naming the step or parameter.

    ``param_atol``: every element within it. ``max_update_error``: the final
    parameters' distance from the reference, relative to the reference's total
    update, at most this (for low precision, where elementwise checks only see rounding).
    """
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= loss_rtol * abs(b), f"step {step}: loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert abs(a - b) <= max(loss_rtol, 1e-4) * abs(b), f"step {step}: grad norm {a} vs reference {b}"
    assert got["params"].keys() == ref["params"].keys()
    if max_update_error is not None:
        err = update_error(got, ref)
        assert err <= max_update_error, f"parameters off by {err:.3f} of the reference update (> {max_update_error})"
    for name, ref_p in ref["params"].items() if param_atol is not None else ():
        diff = (got["params"][name] - ref_p).abs().max().item()
        assert diff <= param_atol, f"parameter {name}: max abs diff {diff:.3g} > {param_atol}"


def many(fn_name: str, specs: list) -> list:
    """Run several cases in one round-trip (saves the pipe latency, not compute)."""
    fn = globals()[fn_name]
    return [fn(s) for s in specs]


def volume_case(spec: dict) -> dict:
    """One step on one micro-batch: the step's collective volume, and resident bytes after zero_grad."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = build_model(spec.get("model", "gpt"))
    model, opt = infinity.initialize(model, config_for(spec))
    engine = infinity.engine_of(model)
    ids = global_batch(0, 2 * world).chunk(world)[rank]
    _loss(model, ids).backward()
    opt.step()
    volume = dict(engine.stats.last_step["collectives"]["volume_elements"])
    coll_bytes = dict(engine.stats.last_step["collectives"]["bytes"])
    opt.zero_grad()
    return {"volume": volume, "bytes": coll_bytes, "resident": engine.resident_bytes(),
            "psi": engine.padded_numel, "root_psi": sum(u.padded_numel for u in engine.units if u.is_root),
            "shard_world": engine.shard_world}


def fp16_case(spec: dict) -> dict:
    """fp16 with loss scaling: per step the scale, whether it was skipped, and whether params moved."""
    return fp16_run(spec, config_for(dict(spec, dtype="fp16", reduce=spec.get("reduce", "fp32"))))


def fp16_run(spec: dict, cfg: dict) -> dict:
    """fp16_case with a given config (its precision section is set here)."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = build_model("gpt")
    cfg["precision"].update(param_dtype="fp16", initial_loss_scale=spec["scale"],
                            loss_scale_window=spec.get("window", 1000))
    model, opt = infinity.initialize(model, cfg)
    engine = infinity.engine_of(model)
    scales, skipped, moved, losses = [], [], [], []
    for step in range(spec["steps"]):
        with engine.gathered():
            before = [p.detach().clone() for p in model.parameters()]
        ids = global_batch(step, spec["batch"]).chunk(world)[rank]
        loss = _loss(model, ids)
        loss.backward()
        total = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
        skipped_before = opt.skipped_steps
        opt.step()
        opt.zero_grad()
        scales.append(engine.loss_scaler.scale)
        skipped.append(opt.skipped_steps - skipped_before)
        with engine.gathered():
            moved.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    engine.close()
    return {"scales": scales, "skipped": skipped, "moved": moved, "losses": losses,
            "scaler_skipped": engine.loss_scaler.skipped_steps}


def error_case(kind: str) -> str:
    """Provoke one misuse on every rank; returns the error message (the world stays usable)."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        if kind == "structure":
            torch.manual_seed(0)
            model = CrossTied(width=32 if rank == 0 else 48)
            infinity.initialize(model, {"zero": {"stage": 2}})
        elif kind == "groups":
            model = build_model("gpt")
            spec = dict(groups=True, lr=1e-3)
            groups = param_groups(model, spec)
            if rank == 1:
                groups = groups[::-1]
            infinity.initialize(model, {"zero": {"stage": 1}}, params=groups)
        else:
            raise ValueError(f"unknown error case {kind!r}")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# ---------------------------------------------------------------- tolerances against the reference

FP32_TOL = dict(loss_rtol=1e-5, param_atol=2e-5)
BF16_TOL = dict(loss_rtol=5e-3, max_update_error=0.25)

_REF_CACHE: dict = {}


def reference(spec: dict) -> dict:
    """The reference run for ``spec``, cached per process: stage, dtype, reduce dtype and reshard do not
    change what plain single-process AdamW computes."""
    key = tuple(sorted((k, v) for k, v in spec.items() if k not in ("stage", "dtype", "reduce", "reshard")))
    if key not in _REF_CACHE:
        _REF_CACHE[key] = reference_run(spec)
    return _REF_CACHE[key]
