"""A DeepSpeed user's Trainer fine-tune inside a container's memory grant, beside the stock Trainer.

    sudo python tools/bench_trainer_offload.py [--size medium] [--grant 1:6GiB,2:8GiB] [--world 1,2] [--steps 4]
                                               [--block-size 256] [--work DIR] [--timeout-s 3600] [--json]

Writes (once, cached in ``--work``) a local pretrained checkpoint: a GPT-2 of ``--size`` (``small``,
``medium`` = 24 x 1024, 355M parameters, ``large``, or ``n_layer=..,n_embd=..,n_head=..``), seeded random
weights saved with ``save_pretrained`` (safetensors), dropout off so two runs' losses compare; and a text
corpus from the repository's docs (bytes as tokens, the example's behaviour without a tokenizer). Then,
for each world size N of ``--world``:

- infinity: ``torchrun --standalone --nproc_per_node N examples/run_clm_infinity.py --infinity_config
  ds_config.json``, the script unchanged and the config ``examples/ds_config_zero3_nvme.json`` with only
  its ``nvme_path`` pointed into the work directory. It runs inside a cgroup memory grant of ``--grant``
  bytes (one size, or one per world size) made for it (``tests/helpers/memory_cgroup.py``: created
  before, removed after, also on failure, bounded by ``--timeout-s``), so ``tiers.host_bytes`` and the
  CPU device tier, ``auto``, are sized from the grant. The script runs through a shim that turns on the
  ``infinity.store.budget`` logger (each rank's resolved budgets and the grant it saw), then ``runpy``s
  the script as ``__main__``.
- the stock Trainer: the same script with its four ``# [infinity]`` lines put back (``Trainer``,
  ``TrainingArguments``, ``AutoModelForCausalLM.from_pretrained``), the same arguments without
  ``--infinity_config``, under the same torchrun, with no grant (DDP at N > 1).

Recorded per run: the fp32 training state (16 bytes a parameter: parameter, gradient, two Adam moments),
each rank's resolved host and device budgets and the ratio of the state to the host budget, each rank's
peak RSS (its ``VmHWM`` in ``/proc/<pid>/status``, polled every 0.2 s until it exits; the largest is
checked against the kernel's ``ru_maxrss`` of the launcher's process tree, from ``wait4``), the grant's
own peak charge (page cache included), the bound on a rank's peak RSS
(:func:`infinity.estimate.peak_rss.bound_for_model` for the config the trainer resolved at that world
size with the budgets the rank logged; its baseline term a stand-in: a fresh process's RSS with
transformers, infinity and torch's runtime loaded), the step time (median interval between the
Trainer's per-step log lines after the first, which records the gather order) and the per-step losses,
compared with the stock Trainer's (rank-averaged, as the Trainer logs them). The script's whole run
(load, train, ``save_model``, evaluate) is inside the grant. Swap directories and output directories are
removed after each run (``--keep`` keeps the outputs). The machine is recorded
(:func:`infinity.precision.hardware_record`). Needs root and a writable cgroup memory controller.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "helpers"))

GIB = 2**30
STATE_BYTES_PER_PARAM = 16   # fp32 parameter, gradient and two Adam moments (the master is the parameter)
POLL_S = 0.2
SIZES = {"small": "n_layer=12,n_embd=768,n_head=12", "medium": "n_layer=24,n_embd=1024,n_head=16",
         "large": "n_layer=36,n_embd=1280,n_head=20"}
EXAMPLE = REPO / "examples" / "run_clm_infinity.py"
DS_CONFIG = REPO / "examples" / "ds_config_zero3_nvme.json"
# the example's marked lines and the stock script's (run_clm.py's) originals
STOCK_LINES = [
    ("from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments, from_pretrained",
     "from transformers import Trainer, TrainingArguments"),
    ("InfinityTrainingArguments))  # [infinity]", "TrainingArguments))"),
    ("model = from_pretrained(model_args.model_name_or_path)  # [infinity] was: AutoModelForCausalLM.from_pretrained(",
     "model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)"),
    ("trainer = InfinityTrainer(  # [infinity] was: Trainer(; it reads --infinity_config", "trainer = Trainer("),
]
SHIM = '''"""Runs a script as __main__ with infinity's budget log on (each rank's resolved tier budgets)."""
import logging, os, runpy, sys
logging.basicConfig(level=logging.WARNING, format="[rank " + os.environ.get("RANK", "0") + "] %(message)s")
logging.getLogger("infinity.store.budget").setLevel(logging.INFO)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'''
BUDGET_LINE = re.compile(r"\[rank (\d+)\] infinity: tier budgets per rank: device (\d+) bytes .*?, host (\d+) bytes "
                         r".*?; (\d+) local rank\(s\), (.*)$")


def parse_grants(text: str, worlds: list) -> dict:
    """``--grant``: one size for every world size, or ``N:SIZE`` pairs (``1:6GiB,2:8GiB``)."""
    from infinity.config import parse_size

    if ":" not in text:
        return {n: parse_size(text, "--grant") for n in worlds}
    grants = {int(n): parse_size(size, "--grant") for n, size in (item.split(":") for item in text.split(","))}
    missing = [n for n in worlds if n not in grants]
    if missing:
        raise SystemExit(f"--grant {text}: no grant for world size {missing[0]}")
    return grants


# ---------------------------------------------------------------- inputs (cached in --work)

def model_overrides(size: str) -> dict:
    spec = SIZES.get(size, size)
    try:
        return {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}
    except ValueError:
        raise SystemExit(f"--size {size!r}: small, medium, large or n_layer=..,n_embd=..,n_head=..") from None


def write_checkpoint(directory: Path, overrides: dict) -> None:
    """A seeded random-init GPT-2 saved with save_pretrained (safetensors), in a process of its own."""
    spec = json.dumps(overrides)
    code = f"""
import json, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
cfg = GPT2Config(**json.loads({spec!r}), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
GPT2LMHeadModel(cfg).save_pretrained({str(directory)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))


def checkpoint(work: Path, size: str) -> Path:
    overrides = model_overrides(size)
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    directory = work / f"gpt2-{tag}"
    if not (directory / "model.safetensors").is_file():
        shutil.rmtree(directory, ignore_errors=True)
        print(f"writing the checkpoint {directory} ...", file=sys.stderr)
        write_checkpoint(directory, overrides)
    return directory


def corpus(work: Path, blocks: int, block_size: int) -> Path:
    """``blocks`` blocks of text from the repository's docs (the example holds out 5% for evaluation)."""
    text = "".join(p.read_text(encoding="utf-8") for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    data = text.encode("utf-8")[: blocks * block_size]
    path = work / "corpus.txt"
    path.write_bytes(data.decode("utf-8", errors="ignore").encode("utf-8"))
    return path


def stock_script(work: Path) -> Path:
    """The example with its ``# [infinity]`` lines put back to the stock script's."""
    code = EXAMPLE.read_text()
    for ours, stock in STOCK_LINES:
        if code.count(ours) != 1:
            raise SystemExit(f"{EXAMPLE}: expected the line {ours!r} once; update STOCK_LINES")
        code = code.replace(ours, stock)
    path = work / "run_clm_stock.py"
    path.write_text(code)
    return path


def ds_config(work: Path, swap: Path) -> Path:
    """examples/ds_config_zero3_nvme.json with its nvme_path in the work directory, otherwise unchanged."""
    cfg = json.loads(DS_CONFIG.read_text())
    for key in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][key]["nvme_path"] = str(swap)
    path = work / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


# ---------------------------------------------------------------- one launch

class Launch:
    """A torchrun job started (in a grant or not), watched until it exits or runs out of time."""

    def __init__(self, cmd: list, cwd: Path, log: Path, timeout_s: float, grant=None):
        self.stdout_lines: list = []   # (seconds since start, line)
        self.peaks: dict = {}          # rank -> {"hwm": bytes, "pid": pid}
        self.timed_out = False
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.t0 = time.monotonic()
        with open(log, "w") as err:
            kwargs = dict(cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            proc = grant.popen(cmd, **kwargs) if grant is not None else subprocess.Popen(cmd, **kwargs)
            reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
            reader.start()
            self.returncode, self.ru_maxrss_bytes = self._watch(proc, timeout_s)
            reader.join(timeout=10)
        self.wall_s = time.monotonic() - self.t0

    def _read(self, stream) -> None:
        for line in stream:
            self.stdout_lines.append((time.monotonic() - self.t0, line.rstrip("\n")))

    def _watch(self, proc, timeout_s: float) -> tuple:
        import psutil

        deadline = self.t0 + timeout_s
        ranks: dict = {}
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)   # reaped here: Popen must not wait again
                return proc.returncode, usage.ru_maxrss * 1024   # KiB; the launcher's tree: it reaps the ranks
            try:
                children = psutil.Process(proc.pid).children()
            except psutil.NoSuchProcess:
                children = []
            for child in children:
                if child.pid not in ranks:
                    ranks[child.pid] = _rank_of(child.pid)
                rank, status_now = ranks[child.pid], _status(child.pid)
                if rank is None or "VmHWM" not in status_now:
                    continue
                peak = self.peaks.setdefault(rank, {"pid": child.pid, "VmHWM": 0, "RssAnon": 0, "RssFile": 0})
                for key in ("VmHWM", "RssAnon", "RssFile"):
                    peak[key] = max(peak[key], status_now.get(key, 0))
            if time.monotonic() > deadline and not self.timed_out:
                self.timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)   # its own session: the launcher and every rank
            time.sleep(POLL_S)


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _status(pid: int) -> dict:
    """The byte figures of ``/proc/<pid>/status`` (VmHWM, RssAnon, RssFile, ...); {} once it has exited."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith(" kB"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def trainer_logs(launch: Launch) -> list:
    """The Trainer's printed log dicts (PrinterCallback, rank 0), with the second they were printed at."""
    out = []
    for t, line in launch.stdout_lines:
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append((t, ast.literal_eval(line)))
            except (ValueError, SyntaxError):
                continue
    return out


def step_figures(launch: Launch, output_dir: Path) -> dict:
    """Step times from when the Trainer printed each step's log line; losses from its trainer_state.json
    (the printed ones have 4 significant digits)."""
    times = [t for t, d in trainer_logs(launch) if "loss" in d and "eval_loss" not in d]
    gaps = [b - a for a, b in zip(times, times[1:])]
    final = next((d for _, d in trainer_logs(launch) if "train_runtime" in d), {})
    try:
        history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    except (OSError, ValueError, KeyError):
        history = []
    try:   # the script evaluates after save_state: its eval metrics are in their own file
        eval_loss = json.loads((output_dir / "eval_results.json").read_text())["eval_loss"]
    except (OSError, ValueError, KeyError):
        eval_loss = None
    return {"losses": [h["loss"] for h in history if "loss" in h], "eval_loss": eval_loss,
            "step_s": statistics.median(gaps) if gaps else None, "step_s_all": gaps,
            "train_runtime_s": final.get("train_runtime")}


# ---------------------------------------------------------------- the bound (a fresh process)

def bound(checkpoint_dir: Path, ds_path: Path, world: int, script_args: list, budgets: dict, block_size: int,
          batch: int) -> dict:
    request = {"checkpoint": str(checkpoint_dir), "ds_config": str(ds_path), "world": world, "args": script_args,
               "host_bytes": budgets["host"], "device_bytes": budgets["device"], "block_size": block_size,
               "batch": batch}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--bound-request", json.dumps(request)],
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the bound's process failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _bound_child(request: dict) -> None:
    """bound_for_model for the config InfinityTrainer resolves from the DeepSpeed config and these arguments,
    with the budgets a rank logged; its baseline: this process's RSS (transformers and infinity imported,
    torch warmed), a stand-in for the script's before ``initialize``."""
    import logging

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser

    import infinity.integrations.transformers as hf
    from infinity.config import Config
    from infinity.estimate.peak_rss import bound_for_model
    from infinity.integrations.trainer_options import load_trainer_config, trainer_config

    logging.disable(logging.WARNING)   # the DeepSpeed reader's "not used" lines were in the run's log
    parser = HfArgumentParser(hf.InfinityTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(request["args"], return_remaining_strings=True)[:1]
    setup = load_trainer_config(request["ds_config"], args)
    config = trainer_config(setup.config, setup.args, schedule_from_config=setup.schedule_from_config).to_dict()
    config["tiers"]["host_bytes"], config["tiers"]["device_bytes"] = request["host_bytes"], request["device_bytes"]
    config = Config.from_dict(config)
    model_config = AutoConfig.from_pretrained(request["checkpoint"])

    def forward(model):
        ids = torch.zeros((request["batch"], request["block_size"]), dtype=torch.long, device="meta")
        return model(input_ids=ids, labels=ids).loss

    rss, need = bound_for_model(lambda: AutoModelForCausalLM.from_config(model_config), config, request["world"],
                                forward, device=torch.device("cpu"))
    print(json.dumps({"rss_bound": rss.to_dict(), "precision": config.to_dict()["precision"],
                      "min_budgets": None if need is None else {t.value: n for t, (n, _) in need.items()}}))


# ---------------------------------------------------------------- a world size

def run_world(n: int, a, work: Path, ckpt: Path, text: Path, stock: Path, shim: Path, num_params: int,
              grant_bytes: int) -> dict:
    from memory_cgroup import MemoryCgroup

    run_dir = work / f"world{n}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    swap = run_dir / "swap"
    ds_path = ds_config(run_dir, swap)
    common = ["--model_name_or_path", str(ckpt), "--train_file", str(text), "--block_size", str(a.block_size),
              "--max_steps", str(a.steps), "--per_device_train_batch_size", str(a.batch), "--learning_rate",
              str(a.lr), "--logging_steps", "1", "--save_strategy", "no", "--use_cpu", "--report_to", "none",
              "--disable_tqdm", "true"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]
    ours_args = [*common, "--output_dir", str(run_dir / "out-infinity"), "--infinity_config", str(ds_path)]
    row: dict = {"world": n, "state_bytes": STATE_BYTES_PER_PARAM * num_params,
                 "state_bytes_per_rank": STATE_BYTES_PER_PARAM * num_params // n, "grant_bytes": grant_bytes}
    try:
        print(f"world {n}: infinity in a {grant_bytes / GIB:.2f} GiB grant ...", file=sys.stderr)
        with MemoryCgroup(grant_bytes) as grant:
            ours = Launch([*torchrun, str(shim), str(EXAMPLE), *ours_args], run_dir, run_dir / "infinity.log",
                          a.timeout_s, grant)
            row["grant_peak_bytes"] = grant.peak_bytes()
            row["grant_oom_kills"] = grant.oom_kills()
            row["grant_path"] = grant.path
        log = (run_dir / "infinity.log").read_text()
        row["infinity"] = _launch_row(ours, run_dir / "out-infinity")
        budgets = {}
        for line in log.splitlines():
            m = BUDGET_LINE.search(line)
            if m:
                budgets[int(m.group(1))] = {"device": int(m.group(2)), "host": int(m.group(3)),
                                            "local_ranks": int(m.group(4)), "grant": m.group(5)}
        row["budgets"] = budgets
        if ours.returncode != 0 or ours.timed_out:
            row["error"] = _error(ours, log)
            return row
        if sorted(budgets) != list(range(n)):
            row["error"] = f"the log names the budgets of ranks {sorted(budgets)}, not of all {n}"
            return row
        bounds = {}
        for rank, b in sorted(budgets.items()):
            key = (b["host"], b["device"])
            if key not in bounds:
                bounds[key] = bound(ckpt, ds_path, n, ours_args, b, a.block_size, a.batch)
            b["rss_bound_bytes"] = bounds[key]["rss_bound"]["total_bytes"]
            b["rss_bound"] = bounds[key]["rss_bound"]
            b["min_budgets"] = bounds[key]["min_budgets"]
            b["state_over_host_budget"] = row["state_bytes"] / b["host"] if b["host"] else None
            b["rank_state_over_host_budget"] = row["state_bytes_per_rank"] / b["host"] if b["host"] else None
            peak = row["infinity"]["peak_rss_bytes"].get(rank)
            b["peak_rss_bytes"] = peak
            b["within_bound"] = peak is not None and peak <= b["rss_bound_bytes"]
        row["precision"] = next(iter(bounds.values()))["precision"] if bounds else None
    finally:
        shutil.rmtree(swap, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(run_dir / "out-infinity", ignore_errors=True)
    if a.no_stock:
        return row
    print(f"world {n}: the stock Trainer, no grant ...", file=sys.stderr)
    try:
        plain = Launch([*torchrun, str(stock), *common, "--output_dir", str(run_dir / "out-stock")], run_dir,
                       run_dir / "stock.log", a.timeout_s)
        log = (run_dir / "stock.log").read_text()
        row["stock"] = _launch_row(plain, run_dir / "out-stock")
        if plain.returncode != 0 or plain.timed_out:
            row["stock"]["error"] = _error(plain, log)
    finally:
        if not a.keep:
            shutil.rmtree(run_dir / "out-stock", ignore_errors=True)
    ours_losses, stock_losses = row["infinity"]["losses"], row["stock"]["losses"]
    if ours_losses and len(ours_losses) == len(stock_losses):
        row["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(ours_losses, stock_losses))
        row["loss_max_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(ours_losses, stock_losses))
    if row["infinity"]["step_s"] and row["stock"]["step_s"]:
        row["step_vs_stock"] = row["infinity"]["step_s"] / row["stock"]["step_s"]
    return row


def _launch_row(launch: Launch, output_dir: Path) -> dict:
    peaks = sorted(launch.peaks.items())
    return {"returncode": launch.returncode, "timed_out": launch.timed_out, "wall_s": launch.wall_s,
            "peak_rss_bytes": {rank: p["VmHWM"] for rank, p in peaks},
            # sampled every POLL_S: anonymous memory, and file pages mapped (the checkpoint's, shared by the ranks)
            "sampled_peak_rss_anon_bytes": {rank: p["RssAnon"] for rank, p in peaks},
            "sampled_peak_rss_file_bytes": {rank: p["RssFile"] for rank, p in peaks},
            "tree_ru_maxrss_bytes": launch.ru_maxrss_bytes, **step_figures(launch, output_dir)}


def _error(launch: Launch, log: str) -> str:
    if launch.timed_out:
        return f"did not finish within {launch.wall_s:.0f} s"
    tail = [ln for ln in log.splitlines() if ln.strip()][-8:]
    return f"exit {launch.returncode}: " + " | ".join(tail)


# ---------------------------------------------------------------- main

def _gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="medium", help="small, medium (355M), large, or n_layer=..,n_embd=..,n_head=..")
    p.add_argument("--grant", default="1:6GiB,2:8GiB", help="the memory grant each infinity run gets (a cgroup "
                   "limit): one size, or N:SIZE,... per world size (default 1:6GiB,2:8GiB)")
    p.add_argument("--world", default="1,2", help="world sizes, comma-separated")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="per_device_train_batch_size")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "infinity-bench-trainer-offload"),
                   help="checkpoint cache, corpus, swap and output directories")
    p.add_argument("--timeout-s", type=float, default=3600, help="the most one launch may run")
    p.add_argument("--no-stock", action="store_true", help="skip the stock Trainer runs")
    p.add_argument("--keep", action="store_true", help="keep the output directories")
    p.add_argument("--json", action="store_true")
    p.add_argument("--bound-request", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.bound_request is not None:
        _bound_child(json.loads(a.bound_request))
        return 0

    from memory_cgroup import unavailable_reason

    why = unavailable_reason()
    if why is not None:
        print(f"bench_trainer_offload: {why}", file=sys.stderr)
        return 2
    worlds = [int(w) for w in a.world.split(",")]
    grants = parse_grants(a.grant, worlds)
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(work, a.size)
    text = corpus(work, max(20, a.steps * a.batch * max(worlds) + 2), a.block_size)
    stock = stock_script(work)
    shim = work / "run_logged.py"
    shim.write_text(SHIM)
    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        num_params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())   # a tied weight is stored once

    rows = [run_world(n, a, work, ckpt, text, stock, shim, num_params, grants[n]) for n in worlds]

    from hardware_note import line as hardware_line
    from infinity.precision import hardware_record

    out = {"model": a.size, "num_params": num_params, "checkpoint": str(ckpt), "grant_bytes": grants,
           "steps": a.steps, "block_size": a.block_size, "batch_per_rank": a.batch, "lr": a.lr,
           "ds_config": str(DS_CONFIG.relative_to(REPO)), "hardware": hardware_record("cpu"), "runs": rows}
    if a.json:
        print(json.dumps(out, indent=2, default=str))
        return 0 if all("error" not in r for r in rows) else 1
    print(hardware_line(out["hardware"]))
    print(f"GPT-2 {a.size}: {num_params:,} parameters, fp32 training state {rows[0]['state_bytes'] / GIB:.2f} GiB; "
          f"{a.steps} steps of {a.batch} x {a.block_size} tokens a rank")
    for r in rows:
        print(f"world {r['world']}, grant {_gib(r['grant_bytes'])} GiB:")
        if "error" in r:
            print(f"  infinity failed: {r['error']}")
            continue
        for rank, b in sorted(r["budgets"].items()):
            print(f"  rank {rank}: host budget {_gib(b['host'])} GiB, device {_gib(b['device'])} GiB; state / host "
                  f"budget {b['state_over_host_budget']:.1f}x (its shard's {b['rank_state_over_host_budget']:.1f}x); "
                  f"peak RSS {_gib(b['peak_rss_bytes'])} GiB, bound {_gib(b['rss_bound_bytes'])} GiB "
                  f"({'within' if b['within_bound'] else 'OVER'})")
        ours = r["infinity"]
        print(f"  infinity: step {ours['step_s']:.1f} s (median of {len(ours['step_s_all'])}), grant peak "
              f"{_gib(r['grant_peak_bytes'])} GiB, OOM kills {r['grant_oom_kills']}, tree ru_maxrss "
              f"{_gib(ours['tree_ru_maxrss_bytes'])} GiB, losses {[round(x, 4) for x in ours['losses']]}")
        stock_row = r.get("stock")
        if stock_row is not None:
            if "error" in stock_row:
                print(f"  stock Trainer failed: {stock_row['error']}")
                continue
            peaks = ", ".join(f"rank {k} {_gib(v)}" for k, v in stock_row["peak_rss_bytes"].items())
            print(f"  stock Trainer: step {stock_row['step_s']:.1f} s, peak RSS {peaks} GiB, losses "
                  f"{[round(x, 4) for x in stock_row['losses']]}")
            if "step_vs_stock" in r:
                print(f"  infinity / stock step time {r['step_vs_stock']:.2f}x; losses differ by at most "
                      f"{r.get('loss_max_abs_diff', float('nan')):.2e} ({r.get('loss_max_rel_diff', float('nan')):.2e} "
                      "relative)")
    return 0 if all("error" not in r for r in rows) else 1


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
