"""Long-context training with activations kept, recomputed or offloaded: step time and peak RSS per sequence
length, beside DeepSpeed's CPU activation checkpointing, in one run.

    .venv/bin/python tools/bench_long_context.py [--seq 2048,4096,8192] [--modes keep,recompute,host,nvme,deepspeed]
        [--layers 12] [--hidden 256] [--intermediate 688] [--heads 4] [--kv-heads 4] [--vocab 1024]
        [--host-budget 256MiB] [--dtype auto] [--steps 2] [--rounds 3] [--threads N] [--grant BYTES]
        [--work DIR] [--peers-root DIR] [--plan PROFILE] [--json]

The workload: a Llama (``transformers`` ``LlamaForCausalLM`` from a ``LlamaConfig``: RMSNorm, RoPE, so any
sequence length, SwiGLU; random init with a fixed seed, no dropout, sdpa attention), batch 1, synthetic
tokens uniform in [0, vocab), one warm-up step and ``--steps`` measured steps per configuration. The default
model is Llama-shaped (intermediate / hidden = 11008 / 4096) and small (12 x 256, 10M parameters), so that
on a 2-core CPU the whole default run fits in about 20 minutes while, at the longest default length, the
activations autograd keeps without recompute are several times ``--host-budget`` (printed per length).

Modes (:data:`MODES`, each run in a fresh child process so its peak RSS is its own), ZeRO-3 on one rank,
everything else in memory, ``tiers.host_bytes`` = ``--host-budget``:

- keep: ``zero.activation_checkpointing: false``, every activation kept from forward to backward;
- recompute: ``true``, each unit keeps only its input and recomputes the rest in backward;
- host / nvme: ``true`` and ``zero.activation_offload: host | nvme``, each unit's saved input moved to host
  memory or to files in a swap directory (``tiers.nvme_path``, under ``--work``) when its forward ends,
  fetched back for its backward;
- keep-host / keep-nvme (not run unless named): offload without recompute, every tensor a unit's backward
  needs moved out (the runtime keeps parameters and tensors under 64 KiB);
- deepspeed: DeepSpeed ZeRO-3 (the peers' venv, ``DS_ACCELERATOR=cpu``, gloo, under ``torchrun
  --standalone --nproc_per_node 1``) on the same model and tokens, each decoder layer run through
  ``deepspeed.checkpointing.checkpoint`` with ``activation_checkpointing.cpu_checkpointing`` on
  with ``partition_activations``, which its CPU copy needs (:data:`DS_ACTIVATION_CHECKPOINTING`; see
  :func:`deepspeed_child` for how it is hooked in); deepspeed-unpartitioned (not run unless named):
  ``cpu_checkpointing`` alone, which fails on a CPU accelerator. Where DeepSpeed cannot run a length, its
  error is recorded in the output.

Per child: the median step time over the measured steps, the process's peak RSS over them (VmHWM, reset
after the warm-up via ``/proc/self/clear_refs``; its RSS right after the reset too), the bytes autograd
saved for backward in the warm-up's forward (unique storages, as seen outside the engine: what a unit's
own hooks hold is not counted), the CPU seconds it and everything else on the machine ran per wall second
of them (others near 0: nothing else competed for the cores), and every step's loss. The infinity modes must give bitwise-equal losses;
the run says whether they did. Rounds run every mode at every length, modes in a rotated order each round,
so machine load hits all alike; figures are medians over rounds, with ratios to keep at the same length.

The dtype: bf16 where ``/proc/cpuinfo`` has ``avx512_bf16`` or ``amx_bf16`` (torch's bf16 matmul is native
there; elsewhere it falls to a reference loop 50-90x slower than fp32, see ``tools/hardware_note.py``), else
fp32; ``--dtype`` overrides. The machine (:func:`infinity.precision.hardware_record`) is recorded.

``--grant BYTES`` runs every child inside a cgroup memory limit of that size (``tests/helpers/
memory_cgroup.py``; needs root) and reports, per mode, the longest of ``--seq`` that completes without an
OOM kill in every round: the longest sequence each fits in a fixed memory grant (a mode killed at one length
is not run at longer ones). The DeepSpeed child's grant holds torchrun's launcher as well as its rank. Step
times under a grant include the kernel's reclaim near its limit: compare times from a run without one.

Every child is bounded in time by its work (:func:`timeout_s`); swap directories, the ``--work``
directory (when the tool made it) and cgroups are removed after each child and on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

GIB, MIB = 2**30, 2**20
MODEL_SEED = 0
DATA_SEED = 1234
RESULT_TAG = "BENCH_LONG_CONTEXT_RESULT "   # prefixes a child's one result line (DeepSpeed logs to stdout too)
OPTIMIZER = {"lr": 3.0e-4, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1}   # both systems alike

# Child time bounds (timeout_s): a fixed allowance to start (import torch and transformers, build the model
# and the engine; ~10 s on an idle 2-core machine) plus the steps' work at a rate no working run is below.
START_S = 300.0
FLOOR_FLOPS_S = 1e9         # torch's bf16 reference loop on a CPU without native bf16 runs about this fast
FLOOR_DISK_BYTES_S = 20e6   # a slow virtual disk, for the nvme mode's writes and reads of the saved inputs
SLACK = 4.0                 # once a system has run: its slowest measured rate so far, divided by this


@dataclass(frozen=True)
class Mode:
    """One configuration measured at every length."""

    name: str            # as --modes names it
    label: str           # as the tables print it
    system: str          # "infinity" or "deepspeed"
    checkpointing: bool  # zero.activation_checkpointing (deepspeed: always on)
    offload: str         # zero.activation_offload: none (the key is left out), host, nvme; deepspeed: cpu


MODES = (
    Mode("keep", "keep", "infinity", False, "none"),
    Mode("recompute", "recompute", "infinity", True, "none"),
    Mode("host", "recompute+host", "infinity", True, "host"),
    Mode("nvme", "recompute+nvme", "infinity", True, "nvme"),
    Mode("keep-host", "keep+host", "infinity", False, "host"),
    Mode("keep-nvme", "keep+nvme", "infinity", False, "nvme"),
    Mode("deepspeed", "DeepSpeed cpu_ckpt", "deepspeed", True, "cpu"),
    Mode("deepspeed-unpartitioned", "DeepSpeed cpu_ckpt alone", "deepspeed", True, "cpu"),
)
PLAN_MODE = Mode("plan", "planner", "plan", True, "none")   # not measured: the planner's child
DEFAULT_MODES = ("keep", "recompute", "host", "nvme", "deepspeed")
# DeepSpeed's activation_checkpointing section per DeepSpeed mode. 0.19.8's cpu_checkpointing copies a
# checkpoint's inputs to the CPU only on its partition path: without partition_activations, on an
# accelerator that is the CPU (is_synchronized_device: no async offload engine), it "copies" them with
# .to("cpu") (the same tensor), empties that tensor, and backward recomputes from the empty one
# ("IndexError: Dimension out of range" in q_proj's view). With one rank the partition is the whole
# tensor, cloned to the CPU: plain cpu_checkpointing. deepspeed-unpartitioned (not run by default) keeps
# that failure on record.
DS_ACTIVATION_CHECKPOINTING = {
    "deepspeed": {"partition_activations": True, "cpu_checkpointing": True,
                  "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False},
    "deepspeed-unpartitioned": {"partition_activations": False, "cpu_checkpointing": True,
                                "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False},
}


# ---------------------------------------------------------------- the workload (both systems' children)

def llama_config(dims: dict, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=dims["vocab"], hidden_size=dims["hidden"],
                       intermediate_size=dims["intermediate"], num_hidden_layers=dims["layers"],
                       num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
                       max_position_embeddings=seq, tie_word_embeddings=False, use_cache=False,
                       attention_dropout=0.0, attn_implementation="sdpa")


def build_model(dims: dict, seq: int):
    """The fp32 model, seeded: the same weights in every child (RoPE has no learned positions, so the
    length does not change them)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(llama_config(dims, seq))
    model.train()
    return model


def token_batches(dims: dict, seq: int, count: int) -> list:
    import torch

    g = torch.Generator().manual_seed(DATA_SEED)
    return [torch.randint(0, dims["vocab"], (1, seq), generator=g) for _ in range(count)]


def step_flops(dims: dict, seq: int, recompute: bool) -> float:
    """Matmul flops of one step: forward (linear layers, causal attention's two products, the LM head),
    backward twice the forward, and with recompute the decoder layers' forward once more."""
    h, i, layers = dims["hidden"], dims["intermediate"], dims["layers"]
    kv = dims["kv_heads"] * (h // dims["heads"])
    layer_params = 2 * h * h + 2 * h * kv + 3 * h * i
    layers_fwd = layers * (2 * layer_params * seq + 2 * seq * seq * h)   # causal: half of 2 x (2 s^2 h)
    head_fwd = 2 * h * dims["vocab"] * seq
    return 3 * (layers_fwd + head_fwd) + (layers_fwd if recompute else 0)


def unit_input_bytes(dims: dict, seq: int, dtype: str) -> int:
    """What recompute keeps (each decoder layer's input) and activation offload moves: layers x seq x hidden."""
    return dims["layers"] * seq * dims["hidden"] * (2 if dtype == "bf16" else 4)


def offloaded_bytes(dims: dict, seq: int, dtype: str, checkpointing: bool) -> int:
    """About what activation offload writes and reads back in one step: the unit inputs with recompute, else
    what the decoder layers save (some 12 hidden-wide and 4 intermediate-wide tensors a token; measured 11.7
    KiB a token a layer at 256 / 688 in bf16)."""
    if checkpointing:
        return unit_input_bytes(dims, seq, dtype)
    width = 12 * dims["hidden"] + 4 * dims["intermediate"]
    return dims["layers"] * seq * width * (2 if dtype == "bf16" else 4)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _machine_busy_s() -> float:
    """CPU seconds every process on the machine has run (user, nice, system, irq, softirq, steal), from
    /proc/stat's first line."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _reset_peak_rss() -> bool:
    """VmHWM back to the RSS now (Linux clear_refs 5); False where that is not allowed. (Not
    ``infinity.zero.memory_report.reset_peak_rss``: the DeepSpeed child runs in the peers' venv, without
    infinity's dependencies.)"""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(forward, update, batches: list) -> dict:
    """One warm-up step (its forward's saved tensors counted), then the measured steps."""
    import torch

    saved: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    times, losses, reset, rss_after_warmup, cpu0, busy0 = [], [], False, None, 0.0, 0.0
    for i, ids in enumerate(batches):
        if i == 1:
            reset = _reset_peak_rss()
            rss_after_warmup = _status_bytes("VmRSS")
            cpu0, busy0 = time.process_time(), _machine_busy_s()
        t0 = time.perf_counter()
        if i == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = forward(ids)
        else:
            loss = forward(ids)
        update(loss)
        losses.append(loss.item())
        if i > 0:
            times.append(time.perf_counter() - t0)
    # CPU seconds per wall second of the measured steps, this process's and everything else's: a figure
    # measured while others ran is slower than the code (torch's threads spin-wait for one that lost its
    # core, so this process's own share does not show it)
    cpu_s, busy_s, wall_s = time.process_time() - cpu0, _machine_busy_s() - busy0, sum(times)
    return {"step_s": statistics.median(times), "step_s_all": times, "peak_rss_bytes": _status_bytes("VmHWM"),
            "rss_after_warmup_bytes": rss_after_warmup, "hwm_reset": reset, "cpu_per_wall": cpu_s / wall_s,
            "others_cpu_per_wall": max(0.0, busy_s - cpu_s) / wall_s,
            "saved_activation_bytes": sum(saved.values()), "losses": losses}


# ---------------------------------------------------------------- the children

def infinity_config(mode: Mode, req: dict) -> dict:
    """The mode as infinity config: data, so a mode the runtime does not know yet fails in its parser."""
    zero = {"stage": 3, "activation_checkpointing": mode.checkpointing}
    if mode.offload != "none":
        zero["activation_offload"] = mode.offload
    tiers = {"host_bytes": req["host_bytes"]}
    if mode.offload == "nvme":
        tiers["nvme_path"] = req["swap_dir"]
    return {"zero": zero, "tiers": tiers, "precision": {"param_dtype": req["dtype"]},
            "optimizer": {**OPTIMIZER, "threads": req["threads"]}}


def infinity_child(req: dict) -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    import infinity

    torch.set_num_threads(req["threads"])
    mode = next(m for m in MODES if m.name == req["mode"])
    model, opt = infinity.initialize(build_model(req["dims"], req["seq"]), infinity_config(mode, req))

    def update(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    out = measure(lambda ids: model(input_ids=ids, labels=ids).loss, update,
                  token_batches(req["dims"], req["seq"], req["steps"] + 1))
    engine = infinity.engine_of(model)
    out["precision"] = {"param_dtype": engine.config.precision.param_dtype,
                        "compute_dtype": engine.config.precision.compute_dtype}
    engine.close()
    return out


def deepspeed_config(req: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
           "steps_per_print": 10**9, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3},
           # torch's AdamW: DeepSpeed's own fused CPU Adam would be JIT-built on first use (minutes)
           "optimizer": {"type": "AdamW", "params": {**OPTIMIZER, "torch_adam": True}},
           "zero_allow_untested_optimizer": True,
           "activation_checkpointing": DS_ACTIVATION_CHECKPOINTING[req["mode"]]}
    if req["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def deepspeed_child(req: dict) -> dict:
    """DeepSpeed ZeRO-3, its activation checkpointing on every decoder layer. transformers runs each
    ``GradientCheckpointingLayer`` through the model's checkpoint function; the public
    ``activation_checkpointing_enable`` takes only torch's, so the function is handed to
    ``_set_gradient_checkpointing``, which that method calls. ``deepspeed.checkpointing.configure`` reads
    ``activation_checkpointing`` from the config (``deepspeed.initialize`` does not)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    torch.set_num_threads(req["threads"])
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = deepspeed_config(req)
    model = build_model(req["dims"], req["seq"])
    deepspeed.checkpointing.configure(None, deepspeed_config=cfg)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def update(loss):
        engine.backward(loss)
        engine.step()

    out = measure(lambda ids: engine(input_ids=ids, labels=ids).loss, update,
                  token_batches(req["dims"], req["seq"], req["steps"] + 1))
    out["precision"] = {"param_dtype": str(next(engine.module.parameters()).dtype).removeprefix("torch.")}
    out["deepspeed"] = deepspeed.__version__
    out["ds_config"] = cfg
    return out


# ---------------------------------------------------------------- the planner's choice (a child per length)

# the planner chooses among the four ways to hold activations; every other knob is what the modes run
PLAN_FIXED = {"zero.stage": 3, "offload.params": "none", "offload.grads": "none", "offload.optimizer": "none",
              "optimizer.update_at": "step", "precision.reduce_dtype": "fp32", "optimizer.master": "fp32"}
PLANNED = {(False, "none"): "keep", (True, "none"): "recompute", (True, "host"): "host", (True, "nvme"): "nvme"}


def plan_child(req: dict) -> dict:
    """``infinity plan`` for this length: the compute timed at it (``run_plan``), the profile's rates, the
    memory granted (``--grant``: the RAM it may use, and the device budget; else the profile machine's RAM
    and the tiers' auto); the mode it chooses, and its predicted step and peak RSS for each of the four."""
    import dataclasses

    import torch

    sys.path.insert(0, str(REPO))
    from infinity.plan import InfeasiblePlan, PlanRequest, make_plan
    from infinity.plan.auto import run_plan
    from infinity.plan.rates import load_profile

    torch.set_num_threads(req["threads"])
    # the training process has built its model before initialize: the baseline the planner measures holds it
    model = build_model(req["dims"], req["seq"])
    rates = load_profile(req["profile"])
    if req.get("grant_bytes"):
        rates = dataclasses.replace(rates, ram_available_bytes=req["grant_bytes"])
    request = PlanRequest(build=lambda: build_model(req["dims"], req["seq"]),
                          loss_fn=lambda model, ids, labels: model(input_ids=ids, labels=labels).loss,
                          model_name="llama", vocab_size=req["dims"]["vocab"], batch=1, seq=req["seq"],
                          host_bytes=req["host_bytes"], device_bytes=req.get("grant_bytes"),
                          nvme_path=req["swap_dir"], param_dtype=req["dtype"],
                          base={"optimizer": dict(OPTIMIZER, threads=req["threads"])}, fixed=PLAN_FIXED)
    plan = run_plan(request, rates)
    compute = plan.compute[req["dtype"]]
    baseline = plan.chosen.prediction.rss.baseline_bytes
    predicted = {}
    for (ckpt, offload), name in PLANNED.items():
        fixed = dict(PLAN_FIXED, **{"zero.activation_checkpointing": ckpt, "zero.activation_offload": offload})
        try:
            one = make_plan(dataclasses.replace(request, fixed=fixed), rates, compute, baseline_bytes=baseline).chosen
            predicted[name] = {"step_s": one.step_s, "peak_rss_bytes": one.prediction.rss.total_bytes}
        except InfeasiblePlan as e:
            predicted[name] = {"unfit": str(e)}
    del model
    k = plan.chosen.knobs
    return {"chosen": PLANNED[(k["zero.activation_checkpointing"], k["zero.activation_offload"])],
            "predicted": predicted, "compute": compute.to_dict()}


# ---------------------------------------------------------------- launching a child

def timeout_s(dims: dict, seq: int, mode: Mode, steps: int, dtype: str, slowest_flops_s: float | None) -> float:
    """The most a child may run: START_S, then its steps' flops at the system's slowest measured rate over
    SLACK (FLOOR_FLOPS_S before it has one, and never below), and the nvme mode's I/O at FLOOR_DISK_BYTES_S."""
    flops_s = FLOOR_FLOPS_S if slowest_flops_s is None else max(FLOOR_FLOPS_S, slowest_flops_s / SLACK)
    work = (steps + 1) * step_flops(dims, seq, mode.checkpointing) / flops_s
    if mode.offload == "nvme":
        work += (steps + 1) * 2 * offloaded_bytes(dims, seq, dtype, mode.checkpointing) / FLOOR_DISK_BYTES_S
    return START_S + work


class Child:
    """A child command, in a memory grant or not, killed with everything it started when time runs out
    or when this process is interrupted (Ctrl-C, SIGTERM)."""

    def __init__(self, cmd: list, env: dict, limit_s: float, grant=None):
        kwargs = dict(env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      start_new_session=True)
        t0 = time.monotonic()
        self.proc = grant.popen(cmd, **kwargs) if grant is not None else subprocess.Popen(cmd, **kwargs)
        self.timed_out = False
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
            self.stdout, self.stderr = self.proc.communicate()
        except BaseException:   # in its own session, the child would outlive this process
            self.kill()
            raise
        self.wall_s = time.monotonic() - t0
        self.returncode = self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the child and its descendants (torchrun's rank runs in a session of its own)."""
        import psutil

        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        for p in [*family, self.proc]:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def result(self) -> dict | None:
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        return json.loads(lines[-1][len(RESULT_TAG):]) if lines and self.returncode == 0 else None

    def error(self) -> str:
        """The exception the child died of (torchrun's own ChildFailedError summary skipped), else its tail."""
        if self.timed_out:
            return f"killed after {self.wall_s:.0f} s (its time bound)"
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in self.stderr.splitlines() if ln.strip()]
        raised = [ln for ln in lines if re.match(r"^(\w+\.)*\w*(Error|Exception)\b", ln)
                  and "ChildFailedError" not in ln]
        if raised:
            return f"exit {self.returncode}: {raised[-1]}"
        return f"exit {self.returncode}: " + " | ".join(lines[-3:])


def launch(mode: Mode, req: dict, a, limit_s: float, grant_bytes: int | None) -> dict:
    """One child for ``mode``; its result, or what went wrong (error, timed_out, oom_killed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(req["threads"]))
    if mode.system in ("infinity", "plan"):
        flag = "--child" if mode.system == "infinity" else "--plan-child"
        cmd = [sys.executable, str(Path(__file__).resolve()), flag, json.dumps(req)]
    else:
        env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(Path(a.peers_root) / "torch_ext"))
        env.pop("PYTHONPATH", None)   # the peers' venv is whole on its own
        cmd = [str(Path(a.peers_root) / "venv" / "bin" / "python"), "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "1", str(Path(__file__).resolve()), "--ds-child", json.dumps(req)]
    row: dict = {"mode": mode.name, "seq": req["seq"], "timeout_s": round(limit_s)}
    if grant_bytes is None or mode.system == "plan":   # the planner is told the grant, not run in it
        child = Child(cmd, env, limit_s)
    else:
        from memory_cgroup import MemoryCgroup   # tests/helpers, on the path since main() checked --grant

        with MemoryCgroup(grant_bytes) as grant:
            child = Child(cmd, env, limit_s, grant)
            row["grant_peak_bytes"] = grant.peak_bytes()
            row["grant_oom_kills"] = grant.oom_kills()
    row["wall_s"] = round(child.wall_s, 1)
    result = child.result()
    if result is not None:
        row.update(result)
        return row
    row["timed_out"] = child.timed_out
    row["oom_killed"] = bool(row.get("grant_oom_kills")) and not child.timed_out
    row["error"] = "killed by the OOM killer (the grant)" if row["oom_killed"] else child.error()
    row["stderr_tail"] = child.stderr[-4000:]
    return row


# ---------------------------------------------------------------- the run

def choose_dtype(asked: str, hardware: dict) -> str:
    if asked != "auto":
        return asked
    cpu = hardware["cpu"]
    return "bf16" if cpu.get("avx512_bf16") or cpu.get("amx_bf16") else "fp32"


def run_all(a, modes: list, seqs: list, dims: dict, dtype: str, host_bytes: int, grant_bytes, run_dir: Path) -> list:
    """Every mode at every length, ``--rounds`` times, modes in a rotated order each round."""
    rows: list = []
    slowest_flops_s: dict = {}   # system -> the slowest rate a child of it has measured
    given_up: dict = {}       # (mode, seq) -> why it is not run again
    if a.plan is not None:
        for seq in seqs:
            req = {"mode": "plan", "dims": dims, "seq": seq, "threads": a.threads, "dtype": dtype,
                   "host_bytes": host_bytes, "swap_dir": str(run_dir / "plan-swap"), "profile": a.plan,
                   "grant_bytes": grant_bytes}
            limit_s = START_S + 8 * step_flops(dims, seq, True) / FLOOR_FLOPS_S   # a warm-up and 3 timed passes
            row = launch(PLAN_MODE, req, a, limit_s, grant_bytes)
            row["round"] = None
            rows.append(row)
            print(f"plan {seq}: " + (row["error"] if "error" in row else f"chooses {row['chosen']}"), file=sys.stderr)
    for r in range(a.rounds):
        for seq in seqs:
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                if (mode.name, seq) in given_up:
                    rows.append({"mode": mode.name, "seq": seq, "round": r, "skipped": given_up[(mode.name, seq)]})
                    continue
                swap = run_dir / f"swap-{mode.name}-{seq}-r{r}"
                req = {"mode": mode.name, "dims": dims, "seq": seq, "steps": a.steps, "threads": a.threads,
                       "dtype": dtype, "host_bytes": host_bytes, "swap_dir": str(swap)}
                limit_s = timeout_s(dims, seq, mode, a.steps, dtype, slowest_flops_s.get(mode.system))
                try:
                    row = launch(mode, req, a, limit_s, grant_bytes)
                finally:
                    shutil.rmtree(swap, ignore_errors=True)
                row["round"] = r
                row["load_avg"] = os.getloadavg()[0]
                rows.append(row)
                if "error" in row:
                    why = f"{row['error']} (round {r + 1})"
                    given_up[(mode.name, seq)] = why
                    if row["oom_killed"]:   # memory grows with length: longer ones would be killed too
                        for longer in (s for s in seqs if s > seq):
                            given_up[(mode.name, longer)] = f"killed by the OOM killer at {seq} (round {r + 1})"
                    print(f"round {r + 1} {mode.name} {seq}: {row['error']}", file=sys.stderr)
                    continue
                flops_s = step_flops(dims, seq, mode.checkpointing) / row["step_s"]
                slowest_flops_s[mode.system] = min(flops_s, slowest_flops_s.get(mode.system, flops_s))
                print(f"round {r + 1} {mode.name} {seq}: {row['step_s']:.2f} s/step, peak RSS "
                      f"{row['peak_rss_bytes'] / GIB:.2f} GiB, saved {row['saved_activation_bytes'] / MIB:.0f} MiB, "
                      f"CPU s per s {row['cpu_per_wall']:.2f} (others {row['others_cpu_per_wall']:.2f}), "
                      f"child {row['wall_s']:.0f} s", file=sys.stderr)
    return rows


def summarize(rows: list, modes: list, seqs: list, grant_bytes) -> dict:
    plans = {r["seq"]: r for r in rows if r["mode"] == "plan"}
    rows = [r for r in rows if r["mode"] != "plan"]
    done = [r for r in rows if "step_s" in r]
    med: dict = {}
    for mode in modes:
        for seq in seqs:
            mine = [r for r in done if r["mode"] == mode.name and r["seq"] == seq]
            if not mine:
                continue
            med.setdefault(mode.name, {})[seq] = {
                k: statistics.median(r[k] for r in mine)
                for k in ("step_s", "peak_rss_bytes", "rss_after_warmup_bytes", "saved_activation_bytes",
                          "others_cpu_per_wall")}
    for by_seq in med.values():
        for seq, v in by_seq.items():
            keep = med.get("keep", {}).get(seq)
            v["step_over_keep"] = v["step_s"] / keep["step_s"] if keep else None
            v["rss_over_keep"] = v["peak_rss_bytes"] / keep["peak_rss_bytes"] if keep else None
    # bitwise-equal losses: every infinity child at a length, all rounds (the same tokens and weights)
    ours = {m.name for m in modes if m.system == "infinity"}
    losses: dict = {}
    for seq in seqs:
        runs = [r for r in done if r["seq"] == seq and r["mode"] in ours]
        if runs:
            losses[seq] = {"modes": sorted({r["mode"] for r in runs}),
                           "bitwise_equal": all(r["losses"] == runs[0]["losses"] for r in runs)}
            ds = [r for r in done if r["seq"] == seq and r["mode"] not in ours]
            if ds:
                losses[seq]["deepspeed_max_abs_diff"] = max(
                    abs(x - y) for r in ds for x, y in zip(r["losses"], runs[0]["losses"]))
    out = {"medians": med, "losses": losses,
           "others_cpu_per_wall_max": max((r["others_cpu_per_wall"] for r in done), default=None),
           "errors": {f"{r['mode']} {r['seq']}": r["error"] for r in rows if "error" in r}}
    if plans:
        out["plan"] = _judge_plans(plans, med, rows)
    if grant_bytes is not None:   # the longest length up to which every child completed, in every round
        failed = {(r["mode"], r["seq"]) for r in rows if "step_s" not in r}
        fits = {}
        for mode in modes:
            fits[mode.name] = None
            for seq in seqs:
                if (mode.name, seq) in failed or seq not in med.get(mode.name, {}):
                    break
                fits[mode.name] = seq
        out["longest_seq_in_grant"] = fits
    return out


def _judge_plans(plans: dict, med: dict, rows: list) -> dict:
    """Per length: the planner's choice; its measured step over the best of the four modes that completed
    (in every round; under --grant, in the grant); each mode's predicted peak RSS over its measured."""
    failed = {(r["mode"], r["seq"]) for r in rows if "step_s" not in r}
    out = {}
    for seq, plan in plans.items():
        if "error" in plan:
            out[seq] = {"error": plan["error"]}
            continue
        ran = {m: med[m][seq] for m in PLANNED.values() if seq in med.get(m, {}) and (m, seq) not in failed}
        best = min(ran, key=lambda m: ran[m]["step_s"]) if ran else None
        chosen = plan["chosen"]
        rss = {m: plan["predicted"][m]["peak_rss_bytes"] / ran[m]["peak_rss_bytes"]
               for m in ran if "peak_rss_bytes" in plan["predicted"].get(m, {})}
        out[seq] = {"chosen": chosen, "best_measured": best, "predicted": plan["predicted"],
                    "chosen_over_best_step": (ran[chosen]["step_s"] / ran[best]["step_s"]
                                              if chosen in ran and best else None),
                    "predicted_over_measured_rss": rss}
    return out


def print_report(out: dict, modes: list, seqs: list) -> None:
    from hardware_note import line as hardware_line

    s = out["summary"]
    d = out["dims"]
    print(hardware_line(out["hardware"]))
    print(f"Llama {d['layers']} x {d['hidden']} (intermediate {d['intermediate']}, {d['heads']} heads, "
          f"{d['kv_heads']} kv heads, vocab {d['vocab']}), batch 1, ZeRO-3 on one rank, {out['dtype']}, "
          f"host budget {out['host_budget_bytes'] / MIB:.0f} MiB; medians of {out['rounds']} round(s) of "
          f"{out['steps']} step(s) after a warm-up")
    keep = s["medians"].get("keep", {})
    for seq in seqs:
        if seq in keep:
            saved = keep[seq]["saved_activation_bytes"]
            print(f"  seq {seq}: keep saves {saved / MIB:.0f} MiB for backward = "
                  f"{saved / out['host_budget_bytes']:.1f}x the host budget; unit inputs (what recompute keeps, "
                  f"recompute+offload moves) {unit_input_bytes(d, seq, out['dtype']) / MIB:.0f} MiB")

    def table(title: str, key: str, scale: float, ratio: str) -> None:
        print(f"{title:22}" + "".join(f"{'seq ' + str(q):>18}" for q in seqs))
        for mode in modes:
            cells = []
            for seq in seqs:
                v = s["medians"].get(mode.name, {}).get(seq)
                if v is None:
                    cells.append("error" if f"{mode.name} {seq}" in s["errors"] else "-")
                elif v[ratio] is None:
                    cells.append(f"{v[key] / scale:.2f}")
                else:
                    cells.append(f"{v[key] / scale:.2f} ({v[ratio]:.2f}x)")
            print(f"  {mode.label:20}" + "".join(f"{c:>18}" for c in cells))

    table("step s (x keep)", "step_s", 1, "step_over_keep")
    table("peak RSS GiB (x keep)", "peak_rss_bytes", GIB, "rss_over_keep")
    for seq, v in s["losses"].items():
        text = f"losses bitwise equal at {seq} ({', '.join(v['modes'])}): {v['bitwise_equal']}"
        if "deepspeed_max_abs_diff" in v:
            text += f"; DeepSpeed's differ by at most {v['deepspeed_max_abs_diff']:.2e}"
        print(text)
    if s["others_cpu_per_wall_max"] is not None:
        print(f"other processes ran up to {s['others_cpu_per_wall_max']:.2f} CPU s per s during a child's measured "
              f"steps, of {out['hardware']['cpu']['cores']} cores (0: nothing else competed)")
    for seq, v in s.get("plan", {}).items():
        if "error" in v:
            print(f"planner at {seq}: {v['error']}")
            continue
        over = v["chosen_over_best_step"]
        print(f"planner at {seq}: chooses {v['chosen']} (measured best of the four: {v['best_measured']}; "
              f"chosen's step {'%.2fx' % over if over else 'not measured'} the best); predicted / measured "
              "peak RSS: " + ", ".join(f"{m} {r:.2f}" for m, r in v["predicted_over_measured_rss"].items())
              + "; predicted step s: " + ", ".join(f"{m} {p['step_s']:.2f}" if "step_s" in p else f"{m} unfit"
                                                   for m, p in v["predicted"].items()))
    if "longest_seq_in_grant" in s:
        print(f"longest of {seqs} that fits in a {out['grant_bytes'] / GIB:.2f} GiB grant: " + ", ".join(
            f"{m.label} {s['longest_seq_in_grant'][m.name] or 'none'}" for m in modes))
    for where, error in s["errors"].items():
        print(f"{where}: {error}")


def _terminate(signum, frame):
    raise SystemExit(128 + signum)   # runs the finally blocks: the child killed, swap and cgroup removed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="2048,4096,8192", help="sequence lengths, comma-separated")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, of {', '.join(m.name for m in MODES)}")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688, help="MLP width (default: Llama's 11008 / 4096 ratio)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--host-budget", default="256MiB", help="tiers.host_bytes for every infinity mode")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 where the CPU has avx512_bf16 or amx_bf16, else fp32")
    p.add_argument("--steps", type=int, default=2, help="measured steps per child, after one warm-up")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch and optimizer threads per child (default: the CPUs this process may use)")
    p.add_argument("--grant", default=None, help="run each child in a cgroup memory limit of this size (root)")
    p.add_argument("--work", default=None, help="directory for the swap directories (made and removed; default: "
                   "a new one under the system's temp directory)")
    p.add_argument("--peers-root", default=os.environ.get("PEERS_ROOT", str(REPO.parent / "peers-out")),
                   help="holds DeepSpeed's venv (venv/) and op builds (torch_ext/); default $PEERS_ROOT")
    p.add_argument("--plan", default=None, metavar="PROFILE",
                   help="also ask the planner (this `infinity profile` JSON) which of keep / recompute / host / "
                        "nvme to run at each length, told --grant if given; its choice's measured step against "
                        "the best of those that ran (in the grant), its predicted peak RSS against the measured")
    p.add_argument("--reuse", default=None, metavar="RUN.json",
                   help="with --plan: take the measurements from this earlier --json output of the same tool "
                        "(its model, lengths, modes, dtype, budget and grant) and run only the planner")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plan-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ds-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print(RESULT_TAG + json.dumps(infinity_child(json.loads(a.child))), flush=True)
        return 0
    if a.plan_child is not None:
        print(RESULT_TAG + json.dumps(plan_child(json.loads(a.plan_child))), flush=True)
        return 0
    if a.ds_child is not None:
        out = deepspeed_child(json.loads(a.ds_child))
        if int(os.environ.get("RANK", "0")) == 0:
            print(RESULT_TAG + json.dumps(out), flush=True)
        return 0

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE))
    import torch

    from infinity.config import parse_size
    from infinity.precision import hardware_record

    by_name = {m.name: m for m in MODES}
    unknown = [n for n in a.modes.split(",") if n not in by_name]
    if unknown:
        p.error(f"--modes: unknown {unknown[0]!r}; valid: {', '.join(by_name)}")
    modes = [by_name[n] for n in a.modes.split(",")]
    seqs = sorted(int(s) for s in a.seq.split(","))
    dims = {"layers": a.layers, "hidden": a.hidden, "intermediate": a.intermediate, "heads": a.heads,
            "kv_heads": a.kv_heads, "vocab": a.vocab}
    host_bytes = parse_size(a.host_budget, "--host-budget")
    grant_bytes = parse_size(a.grant, "--grant") if a.grant is not None else None
    if grant_bytes is not None:
        sys.path.insert(0, str(REPO / "tests" / "helpers"))
        from memory_cgroup import unavailable_reason

        why = unavailable_reason()
        if why is not None:
            print(f"bench_long_context: --grant: {why}", file=sys.stderr)
            return 2
    if any(m.system == "deepspeed" for m in modes) and not (Path(a.peers_root) / "venv" / "bin" / "python").exists():
        p.error(f"no DeepSpeed venv at {a.peers_root}/venv (see shared/peers/README.md); set --peers-root or "
                "leave deepspeed out of --modes")
    torch.set_num_threads(a.threads)   # the record says the children's threads
    hardware = hardware_record("cpu")
    dtype = choose_dtype(a.dtype, hardware)

    signal.signal(signal.SIGTERM, _terminate)
    made_work = a.work is not None and not Path(a.work).exists()
    if a.work is not None:
        Path(a.work).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-long-context-", dir=a.work))
    if a.reuse is not None:   # the earlier run's workload, measurements and machine; a new planner pass
        if a.plan is None:
            p.error("--reuse needs --plan (it reruns only the planner)")
        old = json.loads(Path(a.reuse).read_text())
        dims, seqs, dtype = old["dims"], old["seqs"], old["dtype"]
        host_bytes, grant_bytes, hardware = old["host_budget_bytes"], old["grant_bytes"], old["hardware"]
        modes = [by_name[m["name"]] for m in old["modes"]]
        a.rounds, a.steps, a.threads = old["rounds"], old["steps"], old["threads"]
    try:
        if a.reuse is not None:
            measured = [r for r in old["runs"] if r["mode"] != "plan"]
            a_rounds, a.rounds = a.rounds, 0   # run_all: the plan children only
            rows = run_all(a, modes, seqs, dims, dtype, host_bytes, grant_bytes, run_dir) + measured
            a.rounds = a_rounds
        else:
            rows = run_all(a, modes, seqs, dims, dtype, host_bytes, grant_bytes, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if made_work:
            shutil.rmtree(a.work, ignore_errors=True)

    out = {"dims": dims, "seqs": seqs, "modes": [asdict(m) for m in modes], "dtype": dtype,
           "host_budget_bytes": host_bytes, "grant_bytes": grant_bytes, "steps": a.steps, "rounds": a.rounds,
           "threads": a.threads,
           "hardware": hardware, "summary": summarize(rows, modes, seqs, grant_bytes), "runs": rows}
    if a.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print_report(out, modes, seqs)
    return 0 if not out["summary"]["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
