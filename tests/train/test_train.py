"""``infinity train``: loss falls at 1 and 2 ranks, metrics/trace files, bad input, Ctrl-C, a failing rank."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from infinity.cli import main
from infinity.train import (DEFAULT_MODEL, DEFAULT_OFFLOAD, RankError, TrainError, TrainOptions, default_config,
                            parse_model_spec)
from infinity.train.launch import _spawn
from infinity.train.resolve import resolve
from cli_output import error_lines

REPO = Path(__file__).resolve().parents[2]
# tiny GPT, 8 x 64 byte tokens a step: a few hundred ms a step on one core
TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3", "--no-progress"]
STEPS = 30


def _fp32_config(tmp_path: Path, stage: int = 3) -> str:
    """The default config (its offload included) in fp32, so runs can be compared to fp32 noise."""
    path = tmp_path / "fp32.json"
    cfg = default_config(tmp_path / "swap", stage).replace(precision={"param_dtype": "fp32"})
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


def _train(capsys, tmp_path, *extra, stage: int = 3) -> tuple[int, dict, list]:
    """Run ``infinity train`` in this process, fp32; (exit code, JSON summary, metrics records)."""
    metrics = tmp_path / "metrics.jsonl"
    rc = main(["train", *TINY, "--steps", str(STEPS), "--json", "--metrics", str(metrics),
               "--config", _fp32_config(tmp_path, stage), *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return rc, json.loads(out), [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Runs that save by default (./checkpoints) save under the test's own directory."""
    monkeypatch.chdir(tmp_path)


def _files_under(path: Path) -> list:
    return [p for p in path.rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    trace = tmp / "trace.json"
    metrics = tmp / "metrics.jsonl"
    argv = ["train", *TINY, "--steps", str(STEPS), "--json", "--metrics", str(metrics), "--trace", str(trace),
            "--config", _fp32_config(tmp), "--no-save"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    assert rc == 0
    return {"summary": json.loads(out.getvalue()), "trace": trace, "swap": tmp / "swap",
            "records": [json.loads(line) for line in metrics.read_text().splitlines()]}


def _assert_loss_falls(records):
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    # byte-level tiny GPT at lr 3e-3: ~5.5 (uniform over 256) falls well below 4 within 30 steps
    assert last < first - 1.0, losses


def test_one_rank_trains_and_loss_falls(one_rank):
    s, records = one_rank["summary"], one_rank["records"]
    assert [r["step"] for r in records] == list(range(STEPS))          # one JSON line per step
    _assert_loss_falls(records)
    assert s["steps"] == STEPS and s["world_size"] == 1 and not s["interrupted"]
    assert s["stage"] == 3 and s["offload"]["optimizer"] == DEFAULT_OFFLOAD["optimizer"]
    assert s["num_params"] == 120_576                                  # tiny: 2 layers x 64 wide, byte vocab
    assert s["last_loss"] == records[-1]["loss"]
    for r in records:
        assert r["tokens"] == 8 * 64 and r["step_s"] > 0 and r["tokens_per_s"] > 0
        # ZeRO-3 counts its collectives at world size 1 too: every gradient reduce-scattered once and
        # every parameter all-gathered at least once (fp32 here), the same every step
        assert r["collective_bytes"]["reduce_scatter"] >= 4 * s["num_params"]
        assert r["collective_bytes"]["all_gather"] >= 4 * s["num_params"]
        assert r["collective_bytes"] == records[0]["collective_bytes"]
        assert sum(r["tier_bytes"].values()) > 0
    assert _files_under(one_rank["swap"]) == []


def test_metrics_and_summary_carry_the_memory_report(one_rank):
    """Each metrics line has the step's peak RSS and where it went; the summary the step with the highest."""
    s, records = one_rank["summary"], one_rank["records"]
    for r in records:
        m = r["memory"]
        assert m["peak_rss_source"] in ("VmHWM", "ru_maxrss")
        assert m["peak_rss_bytes"] is None or m["peak_rss_bytes"] >= m["rss_bytes"] > 0
        assert m["store_host_bytes"] > 0 and m["activation_bytes"] > 0   # the default offload uses the store
    highest = max(records, key=lambda r: r["memory"]["peak_rss_bytes"] or 0)["memory"]
    assert s["memory"] == highest and s["peak_rss_bytes"] == highest["run_peak_rss_bytes"]


def test_trace_is_one_step_of_perfetto_events(one_rank):
    doc = json.loads(one_rank["trace"].read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events}
    assert {"forward", "backward"} <= names
    passes = [e for e in events if e["name"] in ("forward", "backward")]
    assert sorted(e["name"] for e in passes) == ["backward", "forward"]  # one step, one micro-batch
    assert all(e["args"]["step"] == 1 for e in passes)                   # --trace-step (default 1)
    for e in events:
        assert e["dur"] >= 0 and e["pid"] == 0


@pytest.mark.slow
def test_two_ranks_match_one_rank(one_rank, capsys, tmp_path):
    trace = tmp_path / "trace.json"
    _, s, records = _train(capsys, tmp_path, "--nproc", "2", "--trace", str(trace))
    assert [r["step"] for r in records] == list(range(STEPS))
    assert s["world_size"] == 2 and s["steps"] == STEPS
    _assert_loss_falls(records)
    # the same global batch split over two ranks, ZeRO-3 sharded: the loss curve of one rank, to fp32 noise
    for a, b in zip(one_rank["records"], records):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-3), (a["step"], a["loss"], b["loss"])
    pids = {e["pid"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert pids == {0, 1}                                                # both ranks in the one trace file
    assert not list(tmp_path.glob("trace.json.rank*"))
    assert _files_under(tmp_path / "swap") == []


def test_accumulation_at_stage_2(one_rank, capsys, tmp_path):
    # two micro-batches of 4 make the same mean gradient as one batch of 8, and stage 2 the same update as 3
    _, s, records = _train(capsys, tmp_path, "--accum", "2", stage=2)
    assert s["stage"] == 2 and s["accum"] == 2
    for a, b in zip(one_rank["records"], records):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-3)


@pytest.mark.parametrize("stage", (0, 1))
def test_stage_flag_adapts_the_default_offload(stage, capsys, tmp_path):
    rc = main(["train", *TINY, "--steps", "2", "--json", "--stage", str(stage), "--swap-dir", str(tmp_path / "swap")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    s = json.loads(out)
    assert s["stage"] == stage and s["steps"] == 2
    assert s["offload"] == default_config("x", stage).to_dict()["offload"]
    assert s["offload"]["params"] == "none"                 # parameters are sharded at stage 3 only


def test_transformers_model_from_config(capsys, tmp_path):
    pytest.importorskip("transformers")
    metrics = tmp_path / "m.jsonl"
    rc = main(["train", "--model", "hf:GPT2Config:n_layer=2,n_embd=32,n_head=2,n_positions=64", "--steps", "2",
               "--batch-size", "4", "--seq-len", "32", "--no-progress", "--json", "--metrics", str(metrics),
               "--swap-dir", str(tmp_path / "swap")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    s = json.loads(out)
    assert s["steps"] == 2 and s["model"].startswith("hf:GPT2Config")
    # GPT-2 with tied embeddings: wte 256x32 + wpe 64x32 + 2 blocks of 12*32^2+13*32 + ln_f 64
    assert s["num_params"] == 256 * 32 + 64 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 64
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 2 and all(4.0 < x < 7.0 for x in losses)     # ~ln(256) = 5.5 at init


def test_default_config_on_a_text_file(capsys, tmp_path):
    """The default config as it is (bf16), on --data; the human-readable output."""
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    metrics = tmp_path / "m.jsonl"
    rc = main(["train", *TINY, "--steps", "10", "--data", str(data), "--metrics", str(metrics),
               "--swap-dir", str(tmp_path / "swap")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "tiny: 120,576 params, 1 rank(s), ZeRO-3, bf16" in out
    assert "10 steps of 8 x 64 tokens" in out and "loss " in out
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses[-1] < losses[0] - 1.0, losses      # one short sentence, repeated: learnt fast
    assert _files_under(tmp_path / "swap") == []


BAD = [
    (["--model", "gpt5"], "unknown model 'gpt5'; built-in GPT sizes: tiny, 125m"),
    (["--model", "tiny:n_layr=3"], "GPTConfig has no field 'n_layr'"),
    (["--model", "hf:GPT2Config:n_lyer=2"], "GPT2Config has no field 'n_lyer'"),
    (["--model", "hf:NoSuchConfig"], "transformers has no config class 'NoSuchConfig'"),
    (["--device-bytes", "12QB"], "--device-bytes: cannot read '12QB' as a size"),
    (["--corpus-bytes", "lots"], "--corpus-bytes: cannot read 'lots' as a size"),
    (["--seq-len", "65"], "--seq-len 65 exceeds the model's block_size 64"),
    (["--nproc", "3"], "--batch-size 8 does not split evenly over 3 rank(s)"),
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--trace", "t.json", "--trace-step", "5", "--steps", "5"], "--trace-step 5 is past the last step"),
    (["--data", "/nonexistent/corpus.txt"], "--data /nonexistent/corpus.txt: not a readable file"),
    (["--metrics", "/nonexistent/dir/m.jsonl"], "--metrics /nonexistent/dir/m.jsonl: directory /nonexistent/dir"),
    (["--config", "/nonexistent.yaml"], "cannot read config file /nonexistent.yaml"),
    (["--stage", "7"], "argument --stage: invalid choice: 7"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--min-lr", "inf"], "--min-lr must be a finite number >= 0, got inf"),
    (["--clip-grad-norm", "nan"], "--clip-grad-norm must be a finite number >= 0, got nan"),
    (["--val-fraction", "nan"], "--val-fraction must be a finite number in [0, 0.5), got nan"),
    (["--model", "tiny:dropout=nan"], "--model: 'nan' is not a finite number"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "hf:" in " ".join(argv):
        pytest.importorskip("transformers")
    rc = main(["train", *TINY, *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""
    assert not (tmp_path / "infinity_swap").exists()   # nothing started, nothing made


def test_overlapped_update_with_accumulation_and_clipping_is_the_plain_one(capsys, tmp_path):
    """The default config with ``optimizer.update_at`` auto: with its clipping at 1.0 the update runs
    during the next forward, with ``--clip-grad-norm 0`` during the last backward; with ``--accum 2``
    either way it trains to the plain step's losses, bitwise, and the grad norms match."""
    def run(name: str, overlap: bool, *extra) -> list:
        d = tmp_path / name
        d.mkdir()
        cfg = default_config(d / "swap").replace(precision={"param_dtype": "fp32"},
                                                 optimizer={"update_at": "auto" if overlap else "step"})
        (d / "c.json").write_text(json.dumps(cfg.to_dict()))
        rc = main(["train", *TINY, "--steps", "4", "--warmup-steps", "1", "--accum", "2", "--no-save", "--metrics", str(d / "m.jsonl"),
                   "--config", str(d / "c.json"), *extra])
        _, err = capsys.readouterr()
        assert rc == 0, err
        return [(r["loss"], r.get("grad_norm")) for r in map(json.loads, (d / "m.jsonl").read_text().splitlines())]

    clipped = run("clip-off", False)
    assert run("clip-on", True) == clipped
    assert any(norm > 1.0 for _, norm in clipped), clipped   # the clip fired
    unclipped = run("noclip-off", False, "--clip-grad-norm", "0")
    assert run("noclip-on", True, "--clip-grad-norm", "0") == unclipped != clipped


def test_unwritable_swap_dir(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")   # as root chmod does not stop writes; a path under a regular file always fails
    rc = main(["train", *TINY, "--steps", "1", "--swap-dir", str(blocker / "swap")])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert f"swap directory {blocker / 'swap'}: cannot create or write files there (Not a directory)" in err


def test_default_run_plan(tmp_path, monkeypatch):
    """What `infinity train` with no arguments would run (the run itself takes a minute; see the report)."""
    monkeypatch.chdir(tmp_path)
    run = resolve(TrainOptions(), 1)
    assert run.model == parse_model_spec(DEFAULT_MODEL)
    assert run.config == default_config("infinity_swap").replace(schedule={"total_steps": run.steps}).to_dict()
    assert run.config["zero"]["stage"] == 3 and run.config["tiers"]["nvme_path"] == "infinity_swap"
    assert run.config["offload"]["optimizer"] == DEFAULT_OFFLOAD["optimizer"]
    assert run.config["offload"]["params"] == DEFAULT_OFFLOAD["params"]
    # below stage 3 parameters are not sharded, so the default drops their offload instead of failing
    assert default_config("x", stage=2).offload.params == "none"
    assert default_config("x", stage=0).offload.optimizer == "none"


def test_model_grammar():
    s = parse_model_spec("hf:LlamaConfig:hidden_size=64,rope_theta=1e4,tie_word_embeddings=true,"
                         "rope_scaling=none,hidden_act=silu")
    assert (s.kind, s.name) == ("hf", "LlamaConfig")
    assert dict(s.overrides) == {"hidden_size": 64, "rope_theta": 1e4, "tie_word_embeddings": True,
                                 "rope_scaling": None, "hidden_act": "silu"}
    assert parse_model_spec("125M:n_layer=2").name == "125m"
    for bad, message in (("tiny:n_layer", "'n_layer' is not KEY=VALUE"), ("a:b:c", "expected NAME[:KEY=VALUE"),
                         ("hf:", "expected hf:CONFIG_CLASS"), ("tiny:n_layer=2,n_layer=3", "n_layer is given twice"),
                         ("", "empty model name")):
        with pytest.raises(TrainError, match=message.replace("[", r"\[")):
            parse_model_spec(bad)


# ---------------------------------------------------------------- Ctrl-C

def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


@pytest.mark.parametrize("nproc", (1, 2))
def test_ctrl_c_stops_cleanly(nproc, tmp_path):
    metrics, swap = tmp_path / "m.jsonl", tmp_path / "swap"
    cmd = [sys.executable, "-m", "infinity.cli", "train", *TINY, "--steps", "100000", "--nproc", str(nproc),
           "--metrics", str(metrics), "--swap-dir", str(swap),
           "--host-bytes", "1MiB"]   # below the tiny model's 1.8 MiB of state: some of it must be in swap files
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):   # the first step is done
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no step finished in 120 s"
            time.sleep(0.05)
        run_dirs = list(swap.iterdir())
        assert len(run_dirs) == 1 and run_dirs[0].name.startswith("run-")   # the run's own swap directory
        if "nvme" in DEFAULT_OFFLOAD.values():
            assert _files_under(swap), "offload to nvme is on but no swap file exists mid-run"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("infinity train: interrupted after step "), err
    assert "Traceback" not in err
    assert list(swap.iterdir()) == []                     # no swap files, no run directory
    steps_done = metrics.read_text().count("\n")
    assert f"interrupted after step {steps_done} of 100000" in lines[0]
    assert f"{steps_done} steps of 8 x 64 tokens" in out


# ---------------------------------------------------------------- a failing rank

def _rank1_fails(run, rank, world_size, stop):
    dist.init_process_group("gloo")
    if rank == 1:
        raise OSError(28, "No space left on device", "/swap/rank1.swap")
    dist.barrier()       # rank 0 waits here for a rank that will never come (gloo's own timeout: 30 min)
    raise AssertionError("rank 0 got past a barrier rank 1 never joined")


def test_failing_rank_is_one_error_and_no_hang(tmp_path):
    run = resolve(TrainOptions(model="tiny", seq_len=64, swap_dir=str(tmp_path / "swap")), 2)
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        _spawn(run, 2, rank_fn=_rank1_fails)
    assert str(info.value).startswith("rank 1 failed: OSError: [Errno 28] No space left on device: '/swap/rank1.swap'")
    assert "\n" not in str(info.value)
    assert "Traceback" in info.value.traceback and "_rank1_fails" in info.value.traceback
    assert time.monotonic() - t0 < 100   # not gloo's 30-minute timeout: rank 0 was killed


@pytest.mark.parametrize("nproc", (1, 2))
def test_divergence_is_one_line_exit_1(nproc, capsys, tmp_path):
    # lr 1e4 sends the weights to inf within a few steps; every rank sees the same averaged nan and stops
    rc = main(["train", *TINY, "--lr", "1e4", "--steps", "20", "--nproc", str(nproc),
               "--swap-dir", str(tmp_path / "swap")])
    _, err = capsys.readouterr()
    assert rc == 1
    assert re.match(r"infinity train: loss is (nan|-?inf) at step \d+: ", err) and err.count("\n") == 1, err
    assert "training diverged; lower --lr (now 10000)" in err
    assert list((tmp_path / "swap").iterdir()) == []


def test_rank_error_exit_1(capsys, monkeypatch):
    def failing(options):
        raise RankError("rank 1 failed: OSError: disk full", "Traceback ...")
    monkeypatch.setattr("infinity.train.train", failing)
    assert main(["train", *TINY]) == 1
    _, err = capsys.readouterr()
    assert err == "infinity train: rank 1 failed: OSError: disk full\n"


# ---------------------------------------------------------------- torchrun

@pytest.mark.slow
def test_torchrun_joins_the_group(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "infinity.cli", "train", *TINY, "--steps", "3", "--json", "--metrics", str(metrics),
           "--swap-dir", str(tmp_path / "swap")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = json.loads(proc.stdout)          # rank 0's summary, printed once
    assert s["world_size"] == 2 and s["steps"] == 3
    assert metrics.read_text().count("\n") == 3
    assert _files_under(tmp_path / "swap") == []
