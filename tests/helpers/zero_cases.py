"""Models, data and rank-side case functions shared by the tests/zero/test_*.py files.

Everything here is importable by the spawned ranks of :mod:`world` (top-level
functions, picklable arguments) and by the pytest process, which computes the
single-process ``torch.optim.AdamW`` reference with the same builders.
"""

from __future__ import annotations

import math
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
    Besides losses and parameters it returns ``param_tol``: per element, how far fp32 rounding alone can
    move another correct implementation's result from this one (:class:`RoundingDrift`).
    """
    torch.set_num_threads(1)
    model = (build or build_model)(spec["model"], spec.get("seed", 0))
    groups = param_groups(model, spec)
    opt = torch.optim.AdamW(groups if groups else model.parameters(), lr=spec["lr"], betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.1)
    sched = make_scheduler(opt, spec)
    init = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    drift = RoundingDrift(model)
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
        drift.after_step(opt, tokens=ids.numel())
        opt.zero_grad()
        if sched:
            sched.step()
    return {"losses": losses, "norms": norms, "init": init, "param_tol": drift.bound,
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


# ---------------------------------------------------------------- fp32 tolerance, from the arithmetic

FP32_UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2   # u = 2**-24: one fp32 operation is within u relative


def adam_ratio_bound(step: int, betas: tuple) -> float:
    """rho_t, the most |m_hat| / sqrt(v_hat) can be after ``step`` Adam steps, whatever the gradients.

    m_hat = sum_k a_k g_k and v_hat = sum_k b_k g_k^2 (bias-corrected, sum_k b_k = 1), so by Cauchy-Schwarz
    |m_hat| <= sqrt(sum_k a_k^2 / b_k) sqrt(v_hat). For betas (0.9, 0.95) it is 1.00 in the first steps.
    """
    b1, b2 = betas
    return (1 - b1) / (1 - b1 ** step) * math.sqrt(
        (1 - b2 ** step) / (1 - b2) * sum((b1 * b1 / b2) ** j for j in range(step)))


class RoundingDrift:
    """Per parameter element, a bound on how far fp32 rounding alone moves two correct AdamW runs apart.

    Two runs of the same model, data and optimizer (the reference in one process, infinity over ranks,
    micro-batches, flat shards and its own update kernel) differ only in the order and grouping of fp32
    sums, and CPUs with other vector units (AVX2 vs AVX-512) sum in other orders again. The bound follows
    that arithmetic, step by step, with the reference's own gradients and AdamW state; nothing is fitted.

    - Gradient. Each gradient element is the same sums in another order: the mean over the ``n`` tokens of
      the global batch (ranks and micro-batches regroup it) and, inside it, matmul contractions of length up
      to K, the largest dimension of any weight matrix (tensor parallelism splits them, and each CPU's BLAS
      blocks them its own way: AVX2 and AVX-512 kernels differ exactly there). Rounding in a sum of
      N = n + K terms is ~sqrt(N) u times the terms' size (Higham and Mary's probabilistic bound), and
      terms that cancel to a mean of size G are each ~sqrt(N) G; with G the largest gradient element of the
      tensor that step, a gradient element may differ by delta_t = (n + K) u max_(k <= t) G_k (the largest
      so far: Adam's moments remember earlier steps).
    - Adam's normalized step r_t = m_hat / (sqrt(v_hat) + eps) moves by at most
      (1 + rho_t) delta_t / (sqrt(v_hat) + eps) for gradients all within delta_t (first order;
      rho_t from :func:`adam_ratio_bound`), and never by more than 2 rho_t (|r_t| <= rho_t on both sides).
      For an element whose gradient is near G that is ~2 (n + K) u of a step (3e-5 at n + K = 256); for one
      whose true gradient is zero (GPT's key bias: softmax ignores it) the gradient is all rounding, Adam
      (eps 1e-8) scales that noise up to a full step, and the bound is 2 rho_t lr: such an element cannot be
      checked, and this says so rather than hiding it in one constant for every element.
    - Update. p <- p (1 - lr wd) - lr r rounds in three operations, each within u of |p| + lr rho_t.

    The bound sums over steps lr_t times the step's difference plus the update's rounding. Parameter
    differences fed back into later gradients are not added separately: for resolved elements they are of
    the rounding's order, an unresolved one barely moves the loss (its gradient is below rounding), and
    the tests run a handful of steps, so nothing compounds.
    """

    def __init__(self, model: nn.Module):
        self.names: dict = {}   # parameter -> its first name
        self.bound: dict = {}   # every name, tied ones too (a state_dict's keys): the same tensor for one parameter
        for n, p in model.named_parameters(remove_duplicate=False):
            first = self.names.setdefault(p, n)
            self.bound[n] = self.bound[first] if first != n else torch.zeros_like(p, dtype=torch.float32)
        self._grad_delta = {}   # parameter name -> delta_t, the gradient rounding bound so far
        # K: every matmul contracts one dimension of its weight (forward the input's, backward the output's)
        self.contraction_numel = max((max(p.shape) for p in self.names if p.dim() >= 2), default=1)

    def after_step(self, opt: torch.optim.Optimizer, tokens: int) -> None:
        """Add the step ``opt`` just took (gradients still in ``.grad``), its loss a mean over ``tokens``."""
        u = FP32_UNIT_ROUNDOFF
        for group in opt.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                name, state = self.names[p], opt.state[p]
                t = int(state["step"])
                rho = adam_ratio_bound(t, group["betas"])
                delta = max(self._grad_delta.get(name, 0.0),
                            (tokens + self.contraction_numel) * u * p.grad.detach().abs().max().item())
                self._grad_delta[name] = delta
                denom = (state["exp_avg_sq"].float() / (1 - group["betas"][1] ** t)).sqrt() + eps
                step_diff = ((1 + rho) * delta / denom).clamp(max=2 * rho)
                self.bound[name] += lr * step_diff + 3 * u * (p.detach().float().abs() + lr * rho)


# ---------------------------------------------------------------- rank side

def config_for(spec: dict) -> dict:
    return {
        "zero": {"stage": spec["stage"], "reshard_after_forward": spec.get("reshard", True),
                 "bucket_bytes": spec.get("bucket_bytes", 16 * 1024),
                 "activation_checkpointing": spec.get("checkpointing", False)},
        "precision": {"param_dtype": spec.get("dtype", "fp32"), "reduce_dtype": spec.get("reduce", "fp32")},
        # spec["optimizer"]: further optimizer keys (stored formats, update_at)
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


def compare(got: dict, ref: dict, loss_rtol: float, within_rounding: bool = False,
            max_update_error: float | None = None) -> None:
    """Per-step loss and final parameters; raises AssertionError naming the step or parameter.

    ``within_rounding``: every element within ``ref["param_tol"]``, what fp32 rounding alone can move it
    (:class:`RoundingDrift`: from the reduction length, fp32's unit roundoff and the reference's own Adam
    steps, never a constant fitted to one CPU). ``max_update_error``: the final parameters' distance from
    the reference, relative to the reference's total update, at most this (for low precision, where
    elementwise checks only see rounding).
    """
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= loss_rtol * abs(b), f"step {step}: loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert abs(a - b) <= max(loss_rtol, 1e-4) * abs(b), f"step {step}: grad norm {a} vs reference {b}"
    assert got["params"].keys() == ref["params"].keys()
    if max_update_error is not None:
        err = update_error(got, ref)
        assert err <= max_update_error, f"parameters off by {err:.3f} of the reference update (> {max_update_error})"
    if within_rounding:
        assert_within_rounding(got["params"], ref)


def assert_within_rounding(params: dict, ref: dict) -> None:
    """Every element of ``params`` (by name: ``ref``'s parameter names, a state_dict will do) within
    ``ref["param_tol"]`` of the reference's; the error names the first parameter and element beyond it."""
    for name, ref_p in ref["params"].items():
        diff = (params[name].float() - ref_p).abs()
        tol = ref["param_tol"][name]
        over = diff - tol
        i = int(over.argmax())
        if over.flatten()[i] > 0:
            move = (ref_p - ref["init"][name]).flatten()[i].item()
            raise AssertionError(
                f"parameter {name}: element {i} off by {diff.flatten()[i].item():.3g} > {tol.flatten()[i].item():.3g}, "
                f"what fp32 rounding can explain (the reference moved it {move:.3g}; "
                f"{int((over > 0).sum())} of {over.numel()} elements over)")


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

FP32_TOL = dict(loss_rtol=1e-5, within_rounding=True)
BF16_TOL = dict(loss_rtol=5e-3, max_update_error=0.25)

_REF_CACHE: dict = {}


def reference(spec: dict) -> dict:
    """The reference run for ``spec``, cached per process: stage, dtype, reduce dtype and reshard do not
    change what plain single-process AdamW computes."""
    key = tuple(sorted((k, v) for k, v in spec.items() if k not in ("stage", "dtype", "reduce", "reshard")))
    if key not in _REF_CACHE:
        _REF_CACHE[key] = reference_run(spec)
    return _REF_CACHE[key]
