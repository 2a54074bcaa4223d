"""Sharded checkpoints: exact resume, resharding across world sizes and stages, consolidation, faults.

Saves happen once, in a module-scoped world of 2 ranks (several models and
stages in one round trip); that world is then restarted, so "resume" runs in
new processes. Exact resume is bitwise (torch.equal) for fp32, bf16 compute
(fp32 masters; the bf16 params are the masters rounded, as after any step) and
fp16 with its loss scaler. Resharding to another world size changes the
reduction order: the loaded state is checked bitwise against the saved one,
and the continued run against single-process torch AdamW with
test_equivalence.py's tolerances: loss within 1e-5 relative, every parameter
element within what fp32 rounding can move it over the 4 steps
(``zero_cases.RoundingDrift``, from the reduction length, fp32's unit roundoff and
the reference's own Adam steps), and a resumed run within twice that of the
uninterrupted one (each is within the bound of the reference).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import checkpoint_cases
from checkpoint_cases import add_extras, build, load_and_continue
from infinity.checkpoint import CheckpointError, consolidate, load_checkpoint, save_checkpoint
from infinity.checkpoint.manifest import Checkpoint
from world import World
from zero_cases import FP32_TOL, assert_within_rounding, build_model, reference_run

REPO = Path(__file__).resolve().parents[2]
BASE = dict(model="gpt", batch=8, lr=1e-2, save_at=2, steps=4)
SPECS = {
    "s0": dict(BASE, stage=0),
    "s1": dict(BASE, stage=1),
    "s3": dict(BASE, stage=3),
    "s3_bf16": dict(BASE, stage=3, dtype="bf16"),
    "s2_fp16": dict(BASE, stage=2, dtype="fp16", loss_scale_window=1, initial_loss_scale=1024.0),
    "tied": dict(BASE, model="cross_tied", stage=2, groups=True, extras=True),
    "gpt2": dict(BASE, model="hf_gpt2", stage=3, steps=2, logits=True),
    "s1_nvme": dict(BASE, stage=1, offload=dict(optimizer="nvme", params="none", grads="none", host_resident_bytes=0)),
    "s3_nvme": dict(BASE, stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host", host_resident_bytes=0)),
}
EXACT = ("s1", "s3", "s3_bf16", "s2_fp16", "s1_nvme", "s3_nvme")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every spec trained and saved at world size 2; then resumed (exact cases) in a restarted world of 2."""
    tmp = tmp_path_factory.mktemp("ckpt")
    roots = {k: str(tmp / k) for k in SPECS}
    # offloaded specs get a swap root of their own (each rank makes its directory below it)
    specs = {k: dict(v, tmp=str(tmp / f"swap_{k}")) if "offload" in v else v for k, v in SPECS.items()}
    with World(2, tmp_path_factory.mktemp("world2")) as w:
        before = w.run(checkpoint_cases.many, "run_and_save", [(specs[k], roots[k]) for k in SPECS])[0]
        w.start()  # new processes: nothing survives but the files
        after = w.run(checkpoint_cases.many, "load_and_continue", [(specs[k], roots[k]) for k in EXACT])[0]
    return {"roots": roots, "before": dict(zip(SPECS, before)), "after": dict(zip(EXACT, after))}


def _assert_states_equal(got: dict, want: dict, ref: dict | None = None) -> None:
    """Bitwise; or, given ``ref`` (the reference run of the same spec), every trained element within twice what
    fp32 rounding can move it (each run is within that of the reference), buffers and the rest bitwise."""
    assert got.keys() == want.keys()
    tol = ref["param_tol"] if ref is not None else {}
    for k, v in want.items():
        if k in tol:
            over = (got[k].float() - v.float()).abs() - 2 * tol[k]
            assert not (over > 0).any(), f"{k}: {int((over > 0).sum())} elements beyond twice the rounding bound"
        else:
            assert torch.equal(got[k], v), f"{k}: max abs diff {(got[k].float() - v.float()).abs().max():.3g}"


# ---------------------------------------------------------------- exact resume

@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_exact_resume_in_new_processes(saved, name):
    before, after = saved["before"][name], saved["after"][name]
    spec = SPECS[name]
    assert after["info"]["step"] == spec["save_at"] and after["info"]["saved_world_size"] == 2
    _assert_states_equal(after["loaded"], before["at_save"])          # the loaded state is the saved one
    assert torch.equal(after["draw"], before["draw"])                  # RNG streams continue where they were
    assert after["losses"] == before["losses"][spec["save_at"]:]       # bitwise, step by step
    _assert_states_equal(after["final"], before["final"])
    assert after["scale_loaded"] == before["scale_at_save"]            # fp16: the loss scaler's state too
    assert after["scale"] == before["scale"]
    if "offload" in spec:  # the state really lived on NVMe when it was saved
        assert before["nvme_bytes_at_save"] > 0
    if name == "s2_fp16":
        assert before["scale_at_save"] != SPECS[name]["initial_loss_scale"]  # it moved: restoring it is under test


def test_saved_layout_and_manifest(saved):
    ckpt = Checkpoint(saved["roots"]["s3"])
    m = ckpt.manifest
    assert ckpt.dir.name == "step_00000002" and (ckpt.dir.parent / "latest").read_text().strip() == ckpt.dir.name
    assert m["world_size"] == 2 and m["stage"] == 3 and m["optimizer"]["group_steps"] == [2]
    assert m["config"]["zero"]["stage"] == 3
    for r in range(2):
        for u in range(len(m["units"])):
            assert f"rank{r:05d}/unit{u:04d}.safetensors" in ckpt.files
    assert not [p for p in ckpt.dir.parent.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------- resharding

@settings(max_examples=200, deadline=None)
@given(numel=st.integers(1, 5000), world=st.integers(1, 8), align=st.sampled_from([1, 8, 1024]),
       lo_frac=st.floats(0, 1), len_frac=st.floats(0, 1))
def test_unit_sources_cover_the_range_exactly(numel, world, align, lo_frac, len_frac):
    chunk = world * align
    shard_numel = max(chunk, -(-numel // chunk) * chunk) // world
    lo = int(lo_frac * numel)
    hi = lo + int(len_frac * (numel - lo))
    ckpt = Checkpoint.__new__(Checkpoint)  # only the layout is needed: no files
    ckpt.units = [{"shard_numel": shard_numel}]
    pieces, at = ckpt.unit_sources(0, lo, hi), 0
    for r, rel, a, b, out_at in pieces:
        assert rel == f"rank{r:05d}/unit0000.safetensors" and 0 <= a < b <= shard_numel and r < world
        assert out_at == at and r * shard_numel + a == lo + at  # contiguous, in order, at the right place
        at += b - a
    assert at == hi - lo

def _check_against_reference(got: dict, spec: dict) -> None:
    ref = reference_run(dict(spec, steps=spec["steps"]))
    for a, b in zip(got["losses"], ref["losses"][spec["save_at"]:]):
        assert abs(a - b) <= FP32_TOL["loss_rtol"] * abs(b), f"loss {a} vs reference {b}"
    assert_within_rounding(got["final"], ref)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    with World(4, tmp_path_factory.mktemp("world4")) as w:
        yield w


def test_reshard_2_to_4(saved, world4):
    jobs = [(dict(SPECS["s3"], stage=2), saved["roots"]["s3"]), (dict(SPECS["tied"], stage=3), saved["roots"]["tied"]),
            (dict(SPECS["s0"], stage=3), saved["roots"]["s0"])]
    s3, tied, s0 = world4.run(checkpoint_cases.many, "load_and_continue", jobs)[0]
    # stage 0 saved the whole state once (rank 0); stage 3 at 4 ranks takes a quarter of it each
    assert s0["info"]["saved_stage"] == 0
    _assert_states_equal(s0["loaded"], saved["before"]["s0"]["at_save"])
    _check_against_reference(s0, SPECS["s0"])
    assert s3["info"]["saved_world_size"] == 2 and s3["group_steps"] == [SPECS["s3"]["steps"]]
    _assert_states_equal(s3["loaded"], saved["before"]["s3"]["at_save"])
    _check_against_reference(s3, SPECS["s3"])
    # two param groups, a cross-unit tie, a buffer and a frozen parameter: equal to the uninterrupted run
    _assert_states_equal(tied["loaded"], saved["before"]["tied"]["at_save"])
    tied_ref = reference_run(SPECS["tied"], build=lambda kind, seed: add_extras(build_model(kind, seed)))
    _assert_states_equal(tied["final"], saved["before"]["tied"]["final"], ref=tied_ref)


@pytest.mark.parametrize("name,stage", [("s3", 0), ("s1", 3)])
def test_reshard_2_to_1(saved, name, stage):
    got = load_and_continue(dict(SPECS[name], stage=stage), saved["roots"][name])  # in this process: world 1
    assert got["info"]["saved_stage"] == SPECS[name]["stage"]
    _assert_states_equal(got["loaded"], saved["before"][name]["at_save"])
    _check_against_reference(got, SPECS[name])


# ---------------------------------------------------------------- consolidate

@pytest.mark.parametrize("name", ["s3", "tied"])
def test_consolidated_equals_state_dict(saved, tmp_path, name):
    from safetensors.torch import load_file

    out = consolidate(saved["roots"][name], tmp_path / "out")
    assert out["files"] == ["model.safetensors"]
    got = load_file(tmp_path / "out" / "model.safetensors")
    _assert_states_equal(got, saved["before"][name]["at_save"])  # tied names, buffers and frozen params included


@pytest.mark.parametrize("kind", ["gpt", "hf_gpt2"])
def test_consolidated_equals_plain_model_state_dict(tmp_path, kind):
    """Saved straight after initialize: consolidation gives back the plain PyTorch model's state_dict()."""
    from safetensors.torch import load_file
    import infinity
    from zero_cases import build_model

    reference = {k: v.detach().clone() for k, v in build_model(kind, seed=0).state_dict().items()}
    model, opt = infinity.initialize(build_model(kind, seed=0), {"zero": {"stage": 3}})
    save_checkpoint(tmp_path / "ckpt", model, opt)
    consolidate(tmp_path / "ckpt", tmp_path / "out")
    _assert_states_equal(load_file(tmp_path / "out" / "model.safetensors"), reference)


def test_consolidate_cli_sharded_bf16(saved, tmp_path):
    from infinity.cli import main
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    assert main(["consolidate", saved["roots"]["tied"], str(out), "--dtype", "bf16",
                 "--max-shard-bytes", "16KiB", "--json"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    want = saved["before"]["tied"]["at_save"]
    assert index["weight_map"].keys() == want.keys()
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    for f in files:  # each file within the cap, unless it is one tensor larger than the cap
        keys = [k for k, v in index["weight_map"].items() if v == f]
        data_bytes = sum(want[k].numel() * (2 if want[k].is_floating_point() else want[k].element_size()) for k in keys)
        assert data_bytes <= 16 * 1024 or len(keys) == 1, f"{f}: {len(keys)} tensors, {data_bytes} bytes"
    got = {}
    for f in files:
        got.update(load_file(out / f))
    expect = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in want.items()}
    _assert_states_equal(got, expect)


def test_consolidate_cli_bad_input(tmp_path, capsys):
    from infinity.cli import main

    assert main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope: no such directory" in err[0]
    assert main(["consolidate", str(tmp_path), str(tmp_path / "out"), "--dtype", "fp8"]) == 2


def test_gpt2_from_pretrained_round_trip(saved, tmp_path):
    from transformers import GPT2LMHeadModel

    consolidate(saved["roots"]["gpt2"], tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        got = model(input_ids=checkpoint_cases.LOGIT_IDS).logits
    assert torch.equal(got, saved["before"]["gpt2"]["at_save_logits"])


# ---------------------------------------------------------------- faults

def _copy(saved, name: str, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(saved["roots"][name], dst)
    return dst / "step_00000002"


def test_corrupt_shard_names_file_and_rank(saved, tmp_path):
    step = _copy(saved, "s3", tmp_path)
    victim = step / "rank00001" / "unit0001.safetensors"
    data = bytearray(victim.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 40] ^= 0xFF  # a byte of the fp32 master
    victim.write_bytes(bytes(data))
    model, opt, _ = build(SPECS["s3"])
    named = r"rank00001/unit0001\.safetensors \(written by rank 1\) is corrupt: tensor 'master' CRC-32"
    with pytest.raises(CheckpointError, match=named):
        load_checkpoint(step, model, opt)
    with pytest.raises(CheckpointError, match=named):
        consolidate(step, tmp_path / "out")


def test_corrupt_shard_fails_every_rank(saved, world4, tmp_path):
    """At 4 ranks, rank 0 reads only saved rank 0's files; every rank must raise, none may hang."""
    step = _copy(saved, "s3", tmp_path)
    victim = step / "rank00001" / "unit0000.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    errors = world4.run(checkpoint_cases.load_error, SPECS["s3"], str(step))
    for rank, msg in enumerate(errors):
        assert "rank00001/unit0000.safetensors (written by rank 1) is corrupt" in msg, (rank, msg)
    assert errors[0].startswith("load_checkpoint failed on rank ")   # told by the rank that found it
    assert not errors[3].startswith("load_checkpoint failed")         # the last quarter is saved rank 1's


def test_tensor_file_rejects_malformed(tmp_path):
    from infinity.checkpoint.tensor_file import TensorFileReader, TensorFileWriter

    path = tmp_path / "t.safetensors"
    w = TensorFileWriter(path, [("a", torch.float32, (3,)), ("b", torch.bfloat16, (2, 2))])
    w.write(torch.arange(3.0))
    w.write(torch.ones(4, dtype=torch.bfloat16))
    w.close()
    from safetensors.torch import load_file
    assert torch.equal(load_file(path)["b"], torch.ones(2, 2, dtype=torch.bfloat16))  # the real format
    good = path.read_bytes()
    with TensorFileReader(path, "test") as r:
        out = torch.empty(2)
        r.read_into("a", 1, 3, out)
        assert out.tolist() == [1.0, 2.0]
        with pytest.raises(CheckpointError, match="cannot read elements"):
            r.read_into("a", 2, 4, torch.empty(2))
    path.write_bytes((10**9).to_bytes(8, "little") + good[8:])
    with pytest.raises(CheckpointError, match=r"header length 1000000000 does not fit"):
        TensorFileReader(path, "test")
    path.write_bytes(good[:-3])
    with pytest.raises(CheckpointError, match=r"tensor 'b' offsets \[12, 20\) disagree"):
        TensorFileReader(path, "test")
    with pytest.raises(CheckpointError, match="File exists"):   # a writer makes a new file, never overwrites
        TensorFileWriter(path, [("a", torch.float32, (3,))])
    w = TensorFileWriter(tmp_path / "short.safetensors", [("a", torch.float32, (3,))])
    w.write(torch.zeros(2))
    with pytest.raises(CheckpointError, match="8 data bytes written, header declares 12"):
        w.close()


def test_missing_rank_files(saved, tmp_path):
    step = _copy(saved, "s3", tmp_path)
    (step / "rank00001" / "unit0000.safetensors").unlink()
    model, opt, _ = build(SPECS["s3"])
    with pytest.raises(CheckpointError, match=r"rank 1's file rank00001/unit0000\.safetensors is missing"):
        load_checkpoint(step, model, opt)
    shutil.rmtree(step / "rank00001")
    with pytest.raises(CheckpointError, match=r"rank 1's index rank00001/index\.json is missing.*world size 2"):
        load_checkpoint(step, model, opt)


def test_manifest_paths_stay_inside(saved, tmp_path):
    step = _copy(saved, "s3", tmp_path)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["ranks"][1]["index"] = "../../etc/passwd"
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"'\.\./\.\./etc/passwd' leaves the checkpoint directory"):
        Checkpoint(step)


def test_format_versions_1_to_3_are_read_and_others_refused_by_name(saved, tmp_path):
    """Version 3 (per-tensor moment formats, int8 ones with their scales) reads versions 1 and 2, whose files
    for fp32 moments are the same; any other version is refused in one line that names it and the versions
    this infinity reads."""
    step = _copy(saved, "s3", tmp_path)
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and set(manifest["shard_tensor_dtypes"].values()) == {"F32"}
    for version in (1, 2, 3):
        (step / "manifest.json").write_text(json.dumps(dict(manifest, format_version=version)))
        model, opt, _ = build(SPECS["s3"])
        load_checkpoint(step, model, opt)
    (step / "manifest.json").write_text(json.dumps(dict(manifest, format_version=4)))
    with pytest.raises(CheckpointError, match=r"format version 4, this version of infinity reads 1, 2 and 3"):
        Checkpoint(step)


def test_layout_mismatch_is_refused(saved):
    model, opt, _ = build(dict(SPECS["s3"], model="cross_tied"))
    with pytest.raises(CheckpointError, match="units|unit .* elements"):
        load_checkpoint(saved["roots"]["s3"], model, opt)


def test_keep_last_and_client_state(tmp_path):
    model, opt, _ = build(dict(BASE, stage=1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(1, 5):
        checkpoint_cases.train(model, opt, BASE, step - 1, step)
        sched.step()
        save_checkpoint(tmp_path, model, opt, step=step, keep_last=2, client_state={"sched": sched.state_dict()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    model2, opt2, _ = build(dict(BASE, stage=3), seed=3)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sched2.load_state_dict(load_checkpoint(tmp_path, model2, opt2)["client_state"]["sched"])
    assert sched2.state_dict() == sched.state_dict() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    with pytest.raises(TypeError, match="client_state must be JSON-serializable"):
        save_checkpoint(tmp_path, model, opt, step=5, client_state={"f": print})
    with pytest.raises(CheckpointError, match="step_00000004 already exists"):
        save_checkpoint(tmp_path, model, opt, step=4)


_KILLED_SAVER = textwrap.dedent("""
    import sys, torch
    import infinity
    from infinity.checkpoint import save_checkpoint
    from infinity.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=512, block_size=16))
    model, opt = infinity.initialize(model, {"zero": {"stage": 1}})
    save_checkpoint(sys.argv[1], model, opt, step=1)
    print("saved", flush=True)
    for step in range(2, 10**6):
        save_checkpoint(sys.argv[1], model, opt, step=step, keep_last=2)
""")


def test_save_killed_midway_leaves_previous_intact(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(_KILLED_SAVER)
    root = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for attempt in range(5):
        shutil.rmtree(root, ignore_errors=True)
        proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, env=env)
        try:
            assert proc.stdout.readline().strip() == b"saved"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # kill once a save is under way (a unit file is being written)
                tmps = [p for p in root.glob(".tmp-step_*") if list(p.glob("rank*/unit*"))]
                if tmps:
                    break
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        if list(root.glob(".tmp-step_*/rank*/unit*")):
            break  # killed mid-write (not between saves): the case under test
    else:
        pytest.fail("could not kill the saver mid-write in 5 attempts")
    complete = sorted(p for p in root.glob("step_*"))
    assert complete, "the first checkpoint was lost"
    for step in complete:  # every published checkpoint verifies completely
        ckpt = Checkpoint(step)
        for rel, (rank, _) in ckpt.files.items():
            ckpt.verify(rel, rank)
    from infinity.models import GPT, GPTConfig
    import infinity
    model, opt = infinity.initialize(GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=512, block_size=16)),
                                     {"zero": {"stage": 1}})
    info = load_checkpoint(root, model, opt)
    assert Path(info["path"]).name == (root / "latest").read_text().strip()


def test_full_disk_keeps_previous(tmp_path):
    model, opt, _ = build(dict(BASE, stage=1))
    probe = save_checkpoint(tmp_path / "probe", model, opt, step=1)
    ckpt_bytes = sum(p.stat().st_size for p in probe.rglob("*") if p.is_file())
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    size_kib = (ckpt_bytes * 3 // 2) // 1024 + 8   # room for one checkpoint, not two
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill ({r.stderr.decode().strip() or 'mount failed'})")
    try:
        first = save_checkpoint(mnt, model, opt, step=1)
        with pytest.raises(CheckpointError, match=r"rank 0 failed \(writing .*No space left on device.*intact"):
            save_checkpoint(mnt, model, opt, step=2)
        assert sorted(p.name for p in mnt.iterdir()) == ["latest", "step_00000001"]  # the temp dir is gone
        model2, opt2, _ = build(dict(BASE, stage=3), seed=7)
        assert load_checkpoint(mnt, model2, opt2)["path"] == str(first)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


_PEAK = textwrap.dedent("""
    import json, sys, torch
    from infinity.checkpoint import consolidate
    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    # warm up on a tiny checkpoint: first-use code pages and caches are not the bound under test
    consolidate(sys.argv[4], sys.argv[2] + "-warmup", buffer_bytes=int(sys.argv[3]))
    base = rss("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to now
    consolidate(sys.argv[1], sys.argv[2], buffer_bytes=int(sys.argv[3]))
    print(json.dumps({"peak_growth_bytes": rss("VmHWM") - base}))
""")


def test_consolidate_peak_memory_is_bounded(tmp_path):
    """A 4M-parameter (16 MiB fp32) matrix, consolidated with a 1 MiB buffer: the process grows by < 4 MiB."""
    import infinity
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False))
    model, opt = infinity.initialize(model, {"zero": {"stage": 1}})
    save_checkpoint(tmp_path / "ckpt", model, opt, step=1)
    tiny, tiny_opt = infinity.initialize(nn.Sequential(nn.Linear(8, 8)), {"zero": {"stage": 1}})
    save_checkpoint(tmp_path / "tiny", tiny, tiny_opt, step=1)
    model_bytes = 2048 * 2048 * 4
    buffer_bytes = 2**20
    # the buffer, the 1 MiB hash chunk and slack; measured: 1 MiB of growth, 16.6 MB with a whole-matrix buffer
    bound_bytes = 4 * 2**20
    script = tmp_path / "peak.py"
    script.write_text(_PEAK)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "out"),
                          str(buffer_bytes), str(tmp_path / "tiny")], capture_output=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    growth = json.loads(out.stdout.decode().strip().splitlines()[-1])["peak_growth_bytes"]
    assert model_bytes >= 4 * bound_bytes
    assert growth < bound_bytes, f"consolidate grew by {growth} bytes, bound {bound_bytes}"
    from safetensors.torch import load_file
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["0.weight"], model[0].weight.detach())


_SAVE_PEAK = textwrap.dedent("""
    import json, sys, torch
    import torch.nn as nn
    import infinity
    from infinity.checkpoint import save_checkpoint
    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    tiny, tiny_opt = infinity.initialize(nn.Sequential(nn.Linear(8, 8)), {"zero": {"stage": 1}})
    save_checkpoint(sys.argv[1] + "-warmup", tiny, tiny_opt, step=1)  # first-use code pages are not under test
    model, opt = infinity.initialize(nn.Sequential(nn.Linear(2048, 2048, bias=False)), {"zero": {"stage": 1}})
    base = rss("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    save_checkpoint(sys.argv[1], model, opt, step=1)
    print(json.dumps({"peak_growth_bytes": rss("VmHWM") - base}))
""")


def test_save_streams_from_the_shards(tmp_path):
    """Saving 48 MiB of optimizer state writes from the shard tensors themselves: the process grows < 4 MiB."""
    script = tmp_path / "save_peak.py"
    script.write_text(_SAVE_PEAK)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    growth = json.loads(out.stdout.decode().strip().splitlines()[-1])["peak_growth_bytes"]
    assert growth < 4 * 2**20, f"save grew the process by {growth} bytes for 48 MiB of state"
    assert Checkpoint(tmp_path / "ckpt").manifest["units"][0]["numel"] == 2048 * 2048
