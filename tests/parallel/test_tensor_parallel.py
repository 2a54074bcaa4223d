"""ZeRO x tensor parallelism on a 2-D (dp, tp) mesh matches single-process torch.optim.AdamW.

One world of 4 ranks runs tp2 x dp2 and tp4 x dp1, one of 2 runs tp2 x dp1;
each case trains the built-in GPT (or HF GPT-2) from the same seed on the same
global batches as the reference, the dp rows each on their share. fp32 tolerances
as in test_equivalence.py (only the summation order of reductions differs; every
element within ``zero_cases.RoundingDrift``'s bound, which also covers the key
bias: its true gradient is zero, so Adam moves it by rounding noise alone).
Also: replicated parameters stay bitwise equal over tp, resident bytes are
16 Ψ_local / dp at stage 3 (Ψ_local = Ψ_split / tp + Ψ_replicated; 16 Ψ / (tp dp)
for the split part), and each mesh axis's collective volume equals
:mod:`infinity.estimate.tensor_parallel`'s.
"""

from __future__ import annotations

import pytest

import tp_cases
from zero_cases import FP32_TOL, reference
from zero_cases import SEQ, compare

BASE = dict(model="gpt", steps=3, batch=8, lr=1e-2)
N_LAYER, N_EMBD = 2, 32   # zero_cases.build_model("gpt")


def _run(worlds, n, specs):
    return worlds(n).run(tp_cases.many_tp, specs)


def _check_volume(spec, got):
    """Per-axis volume of the last step against the estimate (Ψ as the engine padded it)."""
    from infinity.estimate.tensor_parallel import TPSplit, dp_step_volume, tp_step_volume
    last = got["stats"][-1]
    dp_vol = sum(last["collectives"]["volume_elements"].values())
    assert dp_vol == dp_step_volume(got["psi"], got["root_psi"], spec["stage"]), (spec, last["collectives"])
    tokens = spec["batch"] // got["dp"] * SEQ
    split = TPSplit(total=0, split=0, n_layer=N_LAYER, n_embd=N_EMBD)
    tp_vol = last["collectives_tp"]["volume_elements"]
    if spec.get("sp"):
        assert sum(tp_vol.values()) == tp_step_volume(split, tokens, seq_len=SEQ), (spec, tp_vol)
    else:
        assert tp_vol == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": tp_step_volume(split, tokens),
                          "broadcast": 0}, (spec, tp_vol)
    assert last["collectives_world"]["elements"]["all_reduce"] == (1 if spec.get("clip") else 0)


@pytest.mark.slow
def test_tp2_dp2_and_tp4_gpt(worlds, tmp_path):
    """World 4: tp2 x dp2 at stages 0-3 (stage 2 with clipping that bites), tp4 x dp1 at 1 and 3,
    tp2 x dp2 stage 3 with params + optimizer on NVMe, and the same with sequence parallelism."""
    specs = [dict(BASE, stage=s, tp=2) for s in (0, 1, 3)] + [dict(BASE, stage=2, tp=2, clip=0.05)]
    specs += [dict(BASE, stage=s, tp=4) for s in (1, 3)]
    specs += [dict(BASE, stage=3, tp=2, nvme=str(tmp_path / "swap"))]
    # sequence parallelism (parallel.sequence): tp2 x dp2 at 1 and 3, tp4 x dp1 at 3 with clipping
    specs += [dict(BASE, stage=s, tp=2, sp=True) for s in (1, 3)] + [dict(BASE, stage=3, tp=4, sp=True, clip=0.05)]
    per_rank = _run(worlds, 4, specs)
    for spec, got in zip(specs, per_rank[0]):
        ref = reference(spec)
        if spec.get("clip"):
            assert all(n > spec["clip"] for n in ref["norms"])
        compare(got, ref, **FP32_TOL)
        _check_volume(spec, got)
    for rank, results in enumerate(per_rank):
        for spec, got in zip(specs, results):
            assert got["replicated_equal"], f"rank {rank} {spec}: replicated parameters differ over tp"


def test_tp2_dp1_gpt_and_resident_bytes(worlds):
    """World 2: tp2 x dp1 at every stage; fp32 stage 3 resident bytes are 16 Ψ_local (no dp to shard over)."""
    specs = [dict(BASE, stage=s, tp=2) for s in (0, 1, 2, 3)]
    per_rank = _run(worlds, 2, specs)
    for spec, got in zip(specs, per_rank[0]):
        compare(got, reference(spec), **FP32_TOL)
        _check_volume(spec, got)
    r = per_rank[1][3]
    assert r["resident"] == {"params": 4 * r["psi"], "grads": 4 * r["psi"], "optimizer": 8 * r["psi"]}


def test_resident_bytes_stage3(worlds):
    """Stage 3, tp2 x dp2 and tp4 x dp1: every rank holds 16 Ψ_local / dp bytes, Ψ_local = Ψ_split / tp +
    Ψ_replicated (+ padding): the split part is 16 Ψ_split / (tp dp)."""
    from infinity.estimate.tensor_parallel import split_params
    from infinity.parallel.plans import GPT_PLAN
    from zero_cases import build_model
    model = build_model("gpt")
    total = sum(p.numel() for p in model.parameters())
    split = split_params(model, GPT_PLAN)
    assert 0 < split < total
    specs = [dict(BASE, stage=3, tp=2, steps=1), dict(BASE, stage=3, tp=4, steps=1)]
    per_rank = _run(worlds, 4, specs)
    for results in per_rank:
        for spec, r in zip(specs, results):
            tp, dp, psi = spec["tp"], 4 // spec["tp"], r["psi"]
            assert r["resident"] == {"params": 4 * psi // dp, "grads": 4 * psi // dp, "optimizer": 8 * psi // dp}
            local = split // tp + (total - split)
            assert local <= psi < local + 6 * 4096, (psi, local)   # padding: < one 4 KiB block per unit


def test_hf_gpt2_llama_bf16_host_fp16(worlds):
    """tp2 x dp2: HF GPT-2 (Conv1D) at stages 1 and 3 and Llama at stage 3, fp32 tight; the GPT with bf16
    compute (bf16 activation all-reduces) at stage 3 against the fp32 reference, loose as in
    test_zero_equivalence; the GPT with the optimizer on host at stage 2, and at stage 3 with
    optimizer.update_at auto; fp16 overflow skips agree."""
    pytest.importorskip("transformers")
    from zero_cases import BF16_TOL
    specs = [dict(BASE, model="hf_gpt2", stage=s, tp=2) for s in (1, 3)] + [dict(BASE, model="hf_llama", stage=3, tp=2)]
    specs += [dict(BASE, stage=3, tp=2, dtype="bf16"), dict(BASE, stage=2, tp=2, host=True),
              dict(BASE, stage=3, tp=2, host=True, overlap=True)]
    # fp16 from a scale that overflows: every rank skips the same steps, replicated weights stay equal
    specs += [dict(BASE, stage=1, tp=2, dtype="fp16", initial_loss_scale=2.0**60)]
    per_rank = _run(worlds, 4, specs)
    fp16 = [r[-1] for r in per_rank]
    assert fp16[0]["skipped"] >= 1 and all(r["skipped"] == fp16[0]["skipped"] for r in fp16), fp16
    assert all(r["replicated_equal"] for r in fp16)
    for spec, got in zip(specs[:-1], per_rank[0]):
        if spec.get("dtype") == "bf16":
            compare(got, reference(spec), **BF16_TOL)
        else:
            compare(got, reference(spec), **FP32_TOL)


def test_user_plan_and_param_groups(worlds):
    """A model no default plan knows, split by a user plan; two param groups naming the full parameters
    (remapped to their slices) with their own lr and decay; accumulation-free, clipping that bites."""
    from infinity.parallel.tensor_parallel import Colwise, Rowwise
    from zero_cases import reference_run
    plan = {"blocks.*.up": Colwise(), "blocks.*.down": Rowwise()}
    specs = [dict(BASE, model="mlp_stack", stage=s, tp=2, plan=plan, groups=True, clip=0.05) for s in (1, 3)]
    for spec, got in zip(specs, _run(worlds, 4, specs)[0]):
        ref = reference_run(spec, build=tp_cases.build_tp_model)
        assert all(n > spec["clip"] for n in ref["norms"])
        compare(got, ref, **FP32_TOL)


def test_hf_gpt2_consolidate_from_pretrained(worlds, tmp_path):
    """A tp2 x dp2 GPT-2 checkpoint consolidates to files from_pretrained loads, equal to the trained weights."""
    transformers = pytest.importorskip("transformers")
    import torch

    from infinity.checkpoint import consolidate
    spec = dict(BASE, model="hf_gpt2", stage=3, tp=2)
    a = worlds(4).run(tp_cases.tp_segment, spec, None, str(tmp_path / "ckpt"), 0, 1)[0]
    consolidate(a["path"], tmp_path / "hf")
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), a["params"][name]), name


def test_errors(worlds):
    from infinity.parallel.tensor_parallel import Colwise
    cases = [dict(model="gpt", stage=1, lr=1e-3, tp=3),
             dict(model="cross_tied", stage=1, lr=1e-3, tp=2),
             dict(model="gpt", stage=1, lr=1e-3, tp=2, plan={"nothing.*": Colwise()}),
             dict(model="hf_gpt2", stage=1, lr=1e-3, tp=2, sp=True)]
    out = [worlds(2).run(tp_cases.error_tp_case, c)[0] for c in cases]
    assert "parallel.tensor: 3 does not divide the world size 2" in out[0], out[0]
    assert "no default tensor-parallel plan for CrossTied" in out[1], out[1]
    assert "'nothing.*' matches no module" in out[2], out[2]
    assert "no default sequence-parallel plan for GPT2LMHeadModel" in out[3], out[3]


def test_config_section():
    from infinity import Config
    from infinity.config import ConfigError
    assert Config.from_dict({"parallel": {"tensor": 2}}).parallel.tensor == 2
    assert Config().parallel.tensor == 1
    with pytest.raises(ConfigError, match=r"unknown key parallel.tensors.*valid keys: tensor"):
        Config.from_dict({"parallel": {"tensors": 2}})
    with pytest.raises(ConfigError, match=r"parallel.tensor: expected an integer >= 1, got 0"):
        Config.from_dict({"parallel": {"tensor": 0}})
    with pytest.raises(ConfigError, match=r"zeropp: not with parallel.tensor > 1"):
        Config.from_dict({"parallel": {"tensor": 2}, "zeropp": {"quantize_grads": True}})


def test_tensor_parallel_needs_a_world():
    import infinity
    from zero_cases import build_model
    with pytest.raises(ValueError, match=r"parallel.tensor: 2 does not divide the world size 1"):
        infinity.initialize(build_model("gpt"), {"parallel": {"tensor": 2}})


def test_checkpoint_reshard_chain(worlds, tmp_path):
    """tp2 x dp2 (stage 3) -> tp1 x dp1 (stage 1, one process) -> tp2 x dp1 (stage 2), two steps each: the
    losses continue within 5e-5 of an uninterrupted tp2 x dp2 run (also tp2 x dp2 -> tp2 x dp1 directly);
    consolidate gives a plain GPT state dict."""
    import torch

    from infinity.checkpoint import consolidate
    from infinity.models import GPT, GPTConfig
    from zero_cases import VOCAB
    spec = dict(BASE, steps=6)
    whole = _run(worlds, 4, [dict(spec, stage=3, tp=2)])[0][0]["losses"]
    a = worlds(4).run(tp_cases.tp_segment, dict(spec, stage=3, tp=2), None, str(tmp_path / "a"), 0, 2)[0]
    b = tp_cases.tp_segment(dict(spec, stage=1, tp=1), a["path"], str(tmp_path / "b"), 2, 4)
    c = worlds(2).run(tp_cases.tp_segment, dict(spec, stage=2, tp=2), b["path"], str(tmp_path / "c"), 4, 6)[0]
    chain = a["losses"] + b["losses"] + c["losses"]
    worst = max(abs(x - y) for x, y in zip(chain, whole))
    assert worst <= 5e-5, (chain, whole)
    # the same tp ways at another dp (each tp rank reads its own slices by ranges): tp2 x dp2 -> tp2 x dp1
    d = worlds(2).run(tp_cases.tp_segment, dict(spec, stage=1, tp=2), a["path"], str(tmp_path / "d"), 2, 4)[0]
    assert max(abs(x - y) for x, y in zip(d["losses"], whole[2:4])) <= 5e-5, (d["losses"], whole)
    # consolidate the tp2 x dp2 checkpoint: a plain state dict a fresh single-process GPT loads strictly
    out = consolidate(a["path"], tmp_path / "plain")
    from safetensors.torch import load_file
    sd = load_file(tmp_path / "plain" / "model.safetensors")
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ))
    model.load_state_dict(sd, strict=True)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), a["params"][name]), name
    assert out["tensors"] == len(sd)


def test_estimate_tp_rows(capsys):
    """``infinity estimate --tp``: stage-3 state per rank is 16 Ψ_local / dp, and tp-axis volume 8 L C per token."""
    import json

    from infinity.cli import main
    from infinity.models import gpt_config
    assert main(["estimate", "--model", "125m", "--devices", "8", "--tp", "2", "--tokens", "4096", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["tensor_parallel"]
    cfg = gpt_config("125m")
    z3 = next(r for r in rows if r["tp"] == 2 and r["stage"] == 3)
    local = z3["split_params"] // 2 + (z3["params"] - z3["split_params"])
    assert z3["dp"] == 4 and z3["state_bytes_per_rank"] == 16 * -(-local // 4)
    assert z3["tp_volume_elements"] == 8 * cfg.n_layer * cfg.n_embd * 4096
    plain = next(r for r in rows if r["tp"] == 1)
    assert plain["tp_volume_elements"] == 0 and plain["dp"] == 8
    assert main(["estimate", "--params", "7B", "--devices", "8", "--tp", "2"]) == 2
    assert "--tp: needs --model" in capsys.readouterr().err


def test_infinity_train_tp2(capsys, tmp_path, monkeypatch):
    """``infinity train --nproc 2`` with parallel.tensor 2 (the built-in GPT, built on meta, materialized whole
    then split; both tp ranks fed the same batch) follows the one-rank run's losses to fp32 noise."""
    import json

    from infinity.cli import main
    monkeypatch.chdir(tmp_path)
    base = {"zero": {"stage": 3}, "precision": {"param_dtype": "fp32"}}
    losses = {}
    for name, nproc, cfg in (("one", "1", base), ("tp2", "2", dict(base, parallel={"tensor": 2}))):
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        metrics = tmp_path / f"{name}.jsonl"
        rc = main(["train", "--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--steps", "3",
                   "--nproc", nproc, "--config", str(tmp_path / f"{name}.json"), "--no-progress", "--json",
                   "--eval-every", "3", "--save-dir", str(tmp_path / name), "--metrics", str(metrics)])
        summary = json.loads(capsys.readouterr().out)
        assert rc == 0
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
        losses[name].append(summary["val_loss"])
    assert max(abs(a - b) for a, b in zip(losses["one"], losses["tp2"])) < 1e-5, losses


@pytest.mark.parametrize("shape,dim,parts,size", [((12, 8), 0, 3, 2), ((8, 12), 1, 3, 4), ((16,), 0, 1, 4),
                                                  ((6, 4), 1, 1, 2)])
def test_shard_of_and_assemble_round_trip(shape, dim, parts, size):
    """Each of ``parts`` blocks is split ``size`` ways; the slices reassemble the tensor exactly."""
    import torch

    from infinity.parallel.tensor_parallel import TPSpec, assemble, shard_of
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).float()
    spec = TPSpec(dim, parts)
    pieces = [shard_of(full, spec, r, size) for r in range(size)]
    assert all(p.shape[dim] == shape[dim] // size for p in pieces)
    block = shape[dim] // parts
    first = pieces[0].narrow(dim, 0, block // size)   # rank 0 starts with the head of block 0
    assert torch.equal(first, full.narrow(dim, 0, block // size))
    assert torch.equal(assemble(pieces, spec), full)
    with pytest.raises(ValueError, match="not divisible"):
        shard_of(full, TPSpec(dim, parts), 0, shape[dim] + 1)
