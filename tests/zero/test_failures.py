"""The engine survives failure: a backward that raises, ENOSPC in the step's
write-back, cleanup of swap files and I/O threads, a bounded recorded unit order, fp16 unscaling in fp32.

Each comparison is bitwise (``torch.equal`` / float ``==``) against a run of the same config in the
same process: the failed run must end where a run that never met the failure ends.

What a naive engine gets wrong, and these tests pin down:

- a raised backward left ``_in_backward`` set: ``zero_grad()`` raised "during backward", and
  ``step()`` complained there was no backward instead of naming ``zero_grad``;
- ``optimizer.step()`` counted the step (and updated the loss scaler) before the write-back
  failed, so ``group_steps`` / the scaler moved and the retry was a second step;
- ``initialize`` failing after the engine existed, or an engine dropped / a process exiting
  without ``close()``, left the swap file (and, for initialize, four ``infinity-io-*`` threads);
- stage 3 in memory had no ``engine.prefetcher``; on NVMe every no_grad forward appended to the
  prefetcher's seen-list (10,000+ entries), which the next step then adopted as its trace;
- stages 0-2 unscaled fp16 gradients in place in fp16, flushing those under ~3e-8 to zero
  (parameters did not move) and distorting the gradient norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import failure_cases

TIMEOUT_S = 90   # a hang (ranks disagreeing on collectives after a failure) fails instead of waiting 120 s


def ok(per_rank) -> list:
    """The per-rank results; a case that raised on a rank fails the test with that rank's traceback."""
    for rank, r in enumerate(per_rank):
        if "error" in r:
            pytest.fail(f"rank {rank} raised:\n{r['error']}", pytrace=False)
    return per_rank


def assert_same_params(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys()
    differ = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not differ, f"{what}: parameters not bitwise equal to the reference: {differ}"


# ---------------------------------------------------------------- 1. a backward that raises

RAISED_BY = {"function": "Boom: injected failure", ("hook", "mem"): "injected failure in reduce_scatter",
             ("hook", "nvme"): "Input/output error"}


def _raised_marker(inject: str, home: str) -> str:
    return RAISED_BY["function"] if inject == "function" else RAISED_BY[(inject, home)]


def _check_raised(per_rank, inject: str, home: str) -> None:
    marker = _raised_marker(inject, home)
    for rank, r in enumerate(per_rank):
        assert marker in r["raised"], f"rank {rank}: backward raised something else:\n{r['raised']}"


def _check_matches_reference(per_rank, what: str) -> None:
    got = per_rank[0]
    for rank, r in enumerate(per_rank[1:], 1):
        assert r["losses"] == got["losses"], f"{what}: rank {rank} logged other losses"
    ref = got["ref"]
    assert len(got["losses"]) == len(ref["losses"]), (got["batches"], got["ref_batches"])
    assert got["losses"] == ref["losses"], f"{what}: losses {got['losses']} vs reference {ref['losses']}"
    assert_same_params(got["params"], ref["params"], what)


@pytest.mark.parametrize("inject", ("function", "hook"))
@pytest.mark.parametrize("home", ("mem", "nvme"))
@pytest.mark.parametrize("world_size", (1, 2))
def test_raised_backward_then_zero_grad_matches_skipping_the_batch(worlds, tmp_path, world_size, home, inject):
    """Batch 2's backward raises on every rank (inside a unit's autograd Function, or in the engine's
    own hook: a reduce-scatter / an NVMe read of a parameter shard); the loop catches it, calls
    zero_grad() and goes on: losses and parameters equal a run that skipped batch 2."""
    spec = dict(home=home, inject=inject, mode="skip", tmp=str(tmp_path))
    per_rank = ok(worlds(world_size).run(failure_cases.backward_failure_case, spec, timeout_s=TIMEOUT_S))
    _check_raised(per_rank, inject, home)
    _check_matches_reference(per_rank, f"{inject} failure, {home}, world size {world_size}")


@pytest.mark.parametrize("home", ("mem", "nvme"))
@pytest.mark.parametrize("world_size", (1, 2))
def test_step_after_raised_backward_needs_zero_grad(worlds, tmp_path, world_size, home):
    """optimizer.step() right after a raised backward is refused with a RuntimeError naming zero_grad;
    zero_grad() then works and training equals a run that skipped the batch."""
    spec = dict(home=home, inject="function", mode="step_first", tmp=str(tmp_path))
    per_rank = worlds(world_size).run(failure_cases.backward_failure_case, spec, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(per_rank):
        if r.get("step_error") is not None:   # checked first: zero_grad() after it may have failed too
            is_runtime_error, text = r["step_error"]
            assert is_runtime_error and "zero_grad" in text, f"rank {rank}: step() after a raised backward:\n{text}"
    ok(per_rank)
    _check_raised(per_rank, "function", home)
    assert all(r["step_error"] is not None for r in per_rank)
    _check_matches_reference(per_rank, f"step before zero_grad, {home}, world size {world_size}")


@pytest.mark.parametrize("home", ("mem", "nvme"))
@pytest.mark.parametrize("world_size", (1, 2))
def test_checkpoint_save_and_load_after_raised_backward(worlds, tmp_path, world_size, home):
    """After batch 3's backward raises: save_checkpoint succeeds, load_checkpoint of the checkpoint
    saved after batch 1 succeeds, and batches 2-4 trained again from it equal an uninterrupted run."""
    spec = dict(home=home, inject="function", mode="checkpoint", tmp=str(tmp_path))
    per_rank = ok(worlds(world_size).run(failure_cases.backward_failure_case, spec, timeout_s=TIMEOUT_S))
    _check_raised(per_rank, "function", home)
    assert per_rank[0]["batches"] == per_rank[0]["ref_batches"] == [0, 1, 2, 3, 4]
    _check_matches_reference(per_rank, f"checkpoint after a raised backward, {home}, world size {world_size}")


# ---------------------------------------------------------------- 2. ENOSPC in the step's write-back

@pytest.mark.parametrize("dtype", ("fp32", "fp16"))
def test_enospc_in_step_write_back_is_atomic_and_retryable(worlds, tmp_path, dtype):
    """Everything on NVMe; step 1's write-back gets ENOSPC: step() raises naming the cause, the step
    counts (and fp16's dynamic loss scaler) are untouched, a retry once space is back advances them
    by one, and training on ends bitwise where an uninterrupted run does."""
    spec = dict(dtype=dtype, steps=4, fail_at=1, tmp=str(tmp_path))
    r = ok(worlds(1).run(failure_cases.enospc_case, spec, timeout_s=TIMEOUT_S))[0]
    got, ref = r["got"], r["ref"]
    assert got["step_error"] is not None, "optimizer.step() did not raise with ENOSPC injected in its write-back"
    assert "No space left" in got["step_error"], got["step_error"]
    assert got["after_failure"] == got["before"], (
        f"a failed step changed the optimizer / scaler state: before {got['before']}, after {got['after_failure']}")
    if dtype == "fp16":
        assert got["before"]["scaler"] is not None
    before, retry = got["before"], got["after_retry"]
    assert retry["group_steps"] == [s + 1 for s in before["group_steps"]], (before, retry)
    assert retry["skipped_steps"] == before["skipped_steps"] == ref["skipped_steps"] == 0
    assert got["losses"] == ref["losses"]
    assert got["group_steps"] == ref["group_steps"] and got["scaler"] == ref["scaler"]
    assert_same_params(got["params"], ref["params"], f"{dtype}, ENOSPC then retry")


# ---------------------------------------------------------------- 3. cleanup

@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """The cleanup cases, run by failure_cases.cleanup_child in one fresh interpreter (which exits
    without closing the last engine). ``children[kind]``: that case's results."""
    import infinity

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(infinity.__file__)))   # this infinity, not another
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([here, root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    code = "import sys, failure_cases; failure_cases.cleanup_child(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path_factory.mktemp("cleanup"))], env=env,
                          capture_output=True, text=True, timeout=180)
    return proc


def _child(children, kind: str) -> dict:
    proc = children
    assert proc.returncode == 0, f"the cleanup child exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the cleanup child printed no result:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])[kind]


def test_initialize_failing_after_the_engine_exists_leaves_nothing(children):
    """A bad betas in a param group fails initialize after the engine (and its swap file and I/O
    threads) exist: ValueError, and no file under nvme_path, no infinity-io thread alive."""
    r = _child(children, "init_fails")
    assert r["error"] is not None, "initialize accepted betas (0.9, 2.0)"
    assert r["value_error"], f"initialize raised something other than ValueError:\n{r['error']}"
    assert r["files"] == [], f"initialize failed but left {r['files']} under {r['nvme_path']}"
    assert r["threads"] == [], f"initialize failed but left threads alive: {r['threads']}"


def test_engine_dropped_without_close_removes_its_swap_file(children):
    """A trained model + optimizer dropped without engine.close(): gc.collect() removes the swap file."""
    r = _child(children, "dropped")
    assert r["files_while_open"], "the engine made no swap file (the test would prove nothing)"
    assert r["files"] == [], f"model dropped without close left {r['files']} under {r['nvme_path']}"


def test_process_exiting_without_close_removes_its_swap_file(children):
    """A process that trains a step and exits without close leaves no swap file."""
    r = _child(children, "exit")
    assert r["files_while_open"], "the engine made no swap file (the test would prove nothing)"
    left = failure_cases.files_under(r["nvme_path"])
    assert left == [], f"a process exiting without close left {left} under {r['nvme_path']}"


# ---------------------------------------------------------------- 4. bounded recorded order

@pytest.mark.parametrize("home", ("mem", "nvme"))
def test_no_grad_forwards_neither_grow_nor_replace_the_recorded_order(worlds, tmp_path, home):
    """Stage 3 (in memory; params on NVMe): 2,000 no_grad forwards after two steps record nothing,
    the next step keeps the trace (no divergence), and the losses equal a run without them."""
    spec = dict(home=home, evals=2000, tmp=str(tmp_path))
    r = ok(worlds(1).run(failure_cases.eval_forwards_case, spec, timeout_s=TIMEOUT_S))[0]
    got, ref = r["got"], r["ref"]
    assert got["trace"], "no unit order was recorded by two training steps"
    assert got["seen_after_evals"] == 0, f"2,000 no_grad forwards left {got['seen_after_evals']} units seen"
    assert got["trace_after_evals"] == got["trace"]
    assert got["trace_after_step"] == got["trace"], (
        f"the step after the evaluation changed the trace (length {len(got['trace'])} -> "
        f"{len(got['trace_after_step'])})")
    assert got["diverged_after_step"] == got["diverged"]
    assert got["losses"] == ref["losses"]
    assert_same_params(got["params"], ref["params"], f"{home}, after 2,000 no_grad forwards")


# ---------------------------------------------------------------- 5. fp16 unscaling in fp32

@pytest.fixture(scope="module")
def tiny_reference():
    return failure_cases.tiny_reference()


@pytest.mark.parametrize("stage", (0, 1, 2))
@pytest.mark.parametrize("world_size", (1, 2))
def test_fp16_small_gradients_are_unscaled_in_fp32(worlds, tiny_reference, world_size, stage):
    """fp16 compute and reduce, static loss scale 1024, true gradients 1e-9 .. 1e-7: after one AdamW
    step every element whose fp32 gradient exceeds 1e-8 moved by more than lr / 2, and
    clip_grad_norm_ (no clipping) returned the fp32 gradient norm within 1%."""
    ref = tiny_reference
    lr = failure_cases.TINY_LR
    flushable = sum(int(((g.abs() > 1.2e-8) & (g.abs() < 2.9e-8)).sum()) for g in ref["grads"].values())
    assert flushable > 0, "no gradient an fp16 unscale would flush to zero: the model proves nothing"
    r = ok(worlds(world_size).run(failure_cases.fp16_unscale_case, dict(stage=stage), timeout_s=TIMEOUT_S))[0]
    assert r["skipped"] == 0, "the step was skipped (overflow)"
    assert abs(r["norm"] - ref["norm"]) <= 0.01 * ref["norm"], f"grad norm {r['norm']} vs fp32 {ref['norm']}"
    for name, g in ref["grads"].items():
        checked = g.abs() > 1e-8
        assert checked.any(), name
        moved = (r["after"][name].float() - r["before"][name].float()).abs()
        stuck = checked & (moved <= 0.5 * lr)
        assert not stuck.any(), (
            f"{name}: {int(stuck.sum())} of {int(checked.sum())} elements with |grad| > 1e-8 moved <= lr/2 "
            f"(smallest such |grad| {g.abs()[stuck].min().item():.3g}, moved {moved[stuck].min().item():.3g})")
