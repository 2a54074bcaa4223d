import pytest
import torch

from infinity.optim.cpu_adam import CpuAdamW, _adamw_chunk
from infinity.optim.split_master import round_bf16_

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _torch_adamw(param, grads, fused):
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], fused=fused, **HYPER)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    s = opt.state[p]
    return p.detach(), s["exp_avg"], s["exp_avg_sq"]


@pytest.mark.parametrize("numel", [1, 1000, 3 * 4096 + 17])
@pytest.mark.parametrize("threads, chunk", [(1, 256 * 1024), (2, 64), (3, 1000)])
def test_matches_torch_fused_adamw_bitwise(numel, threads, chunk):
    torch.manual_seed(0)
    param = torch.randn(numel)
    grads = [torch.randn(numel) for _ in range(3)]
    ref_p, ref_m, ref_v = _torch_adamw(param, grads, fused=True)

    adam = CpuAdamW(threads=threads, chunk_numel=chunk)
    p, m, v = param.clone(), torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(numel, dtype=torch.bfloat16)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker pool only runs when torch itself is single-threaded
    try:
        for step, g in enumerate(grads, start=1):
            adam.step_(p, g, m, v, step=step, out=out, **HYPER)
    finally:
        torch.set_num_threads(saved_threads)
        adam.close()
    assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(v, ref_v)
    assert torch.equal(out, as_bf16(p))   # the project's bf16 rounding of a master


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_grad_scale_is_applied_as_read_and_leaves_grad_alone(grad_dtype):
    """grad_scale (fp16 unscale x clip coefficient) gives exactly the update of the pre-scaled gradient."""
    torch.manual_seed(3)
    numel, scale = 3 * 4096 + 5, 0.37
    param = torch.randn(numel)
    grads = [torch.randn(numel).to(grad_dtype) for _ in range(2)]
    ref_p, ref_m, ref_v = _torch_adamw(param, [g.float() * scale for g in grads], fused=True)
    adam = CpuAdamW(threads=1, chunk_numel=4096)
    p, m, v = param.clone(), torch.zeros(numel), torch.zeros(numel)
    for step, g in enumerate(grads, start=1):
        before = g.clone()
        adam.step_(p, g, m, v, step=step, grad_scale=scale, **HYPER)
        assert torch.equal(g, before)
    assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(v, ref_v)


def test_close_to_default_torch_adamw():
    torch.manual_seed(1)
    param = torch.randn(5000)
    grads = [torch.randn(5000) for _ in range(5)]
    ref_p, _, _ = _torch_adamw(param, grads, fused=False)
    adam = CpuAdamW(threads=2)
    p, m, v = param.clone(), torch.zeros(5000), torch.zeros(5000)
    for step, g in enumerate(grads, start=1):
        adam.step_(p, g, m, v, step=step, **HYPER)
    torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)


def test_fallback_math_matches_fused():
    torch.manual_seed(2)
    p1, g = torch.randn(777), torch.randn(777)
    m1, v1 = torch.zeros(777), torch.zeros(777)
    p2, m2, v2 = p1.clone(), m1.clone(), v1.clone()
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    _adamw_chunk(p1, g, m1, v1, **kw)
    import infinity.optim.cpu_adam as mod

    saved, mod._HAS_FUSED = mod._HAS_FUSED, False
    try:
        _adamw_chunk(p2, g, m2, v2, **kw)
    finally:
        mod._HAS_FUSED = saved
    torch.testing.assert_close(p1, p2, rtol=1e-6, atol=1e-7)


def test_low_precision_grad_is_upcast():
    torch.manual_seed(3)
    param, g = torch.randn(300), torch.randn(300).to(torch.bfloat16)
    adam = CpuAdamW(threads=1)
    p, m, v = param.clone(), torch.zeros(300), torch.zeros(300)
    adam.step_(p, g, m, v, step=1, **HYPER)
    ref_p, _, _ = _torch_adamw(param, [g.float()], fused=True)
    assert torch.equal(p, ref_p)


def test_bad_shapes_and_dtypes_are_named():
    adam = CpuAdamW(threads=1)
    with pytest.raises(ValueError, match="exp_avg must be a contiguous CPU tensor of 10 elements"):
        adam.step_(torch.zeros(10), torch.zeros(10), torch.zeros(9), torch.zeros(10), step=1, **HYPER)
    with pytest.raises(ValueError, match="param must be fp32"):
        adam.step_(torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10), torch.zeros(10), torch.zeros(10),
                   step=1, **HYPER)
    with pytest.raises(ValueError, match="chunk_numel"):
        CpuAdamW(chunk_numel=0)


def test_with_torch_threads_chunks_run_in_order_and_still_match():
    torch.manual_seed(4)
    param, grads = torch.randn(10_000), [torch.randn(10_000) for _ in range(2)]
    ref_p, _, _ = _torch_adamw(param, grads, fused=True)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        adam = CpuAdamW(threads=2, chunk_numel=1000)
        p, m, v = param.clone(), torch.zeros(10_000), torch.zeros(10_000)
        for step, g in enumerate(grads, start=1):
            adam.step_(p, g, m, v, step=step, **HYPER)
        adam.close()
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(p, ref_p)


def test_device_states_use_the_fused_kernel_only_on_cuda(monkeypatch):
    """The fused kernel is chosen for CUDA devices alone; on any other device the update is the plain
    adamw_ ops, bitwise, and the fused kernel is never called."""
    import infinity.optim.cpu_adam as mod
    from infinity.optim.cpu_adam import adamw_, device_adamw_, uses_fused_adamw

    assert uses_fused_adamw(torch.device("cuda", 1)) and uses_fused_adamw("cuda")
    assert not uses_fused_adamw("cpu") and not uses_fused_adamw("meta")
    monkeypatch.setattr(mod, "_HAS_FUSED", False)
    assert not uses_fused_adamw("cuda")   # a torch without the kernel: the plain ops there too
    monkeypatch.undo()

    torch.manual_seed(3)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    p1, grads = torch.randn(777), [torch.randn(777) for _ in range(3)]
    m1, v1 = torch.zeros(777), torch.zeros(777)
    p2, m2, v2 = p1.clone(), m1.clone(), v1.clone()
    fused_calls = []
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: fused_calls.append(1))
    for step, g in enumerate(grads, start=1):
        device_adamw_(p1, g, m1, v1, step=step, **kw)
        adamw_(p2, g, m2, v2, step=step, **kw)
    assert not fused_calls
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)


def test_the_fused_branch_is_torchs_fused_adamw(monkeypatch):
    """Run on CPU tensors (torch has a CPU build of the same kernel), the CUDA branch's call of the
    fused kernel (step count on the states' device, incremented first) gives torch.optim.AdamW(fused=True)."""
    import infinity.optim.cpu_adam as mod
    from infinity.optim.cpu_adam import device_adamw_

    monkeypatch.setattr(mod, "uses_fused_adamw", lambda device: True)
    torch.manual_seed(4)
    param, grads = torch.randn(3 * 4096 + 17), [torch.randn(3 * 4096 + 17) for _ in range(3)]
    want_p, want_m, want_v = _torch_adamw(param, grads, fused=True)
    p, m, v = param.clone(), torch.zeros_like(param), torch.zeros_like(param)
    for step, g in enumerate(grads, start=1):
        device_adamw_(p, g, m, v, step=step, lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                      eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    assert torch.equal(p, want_p) and torch.equal(m, want_m) and torch.equal(v, want_v)


def as_bf16(t: torch.Tensor) -> torch.Tensor:
    """A master rounded to bf16 the way every master format rounds it (ties away from zero)."""
    return round_bf16_(t.contiguous(), torch.empty(t.shape, dtype=torch.bfloat16))
