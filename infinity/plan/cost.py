"""The cost model: one candidate config's predicted step, by phase and term, peak RSS by term, bytes per tier pair.

The terms are the ones a measured step is attributed to (:mod:`infinity.zero.stats`):
``compute_s``, ``io_wait_s``, ``adam_s``, ``comm_s`` and ``unattributed_s`` per phase (forward,
backward, step), so a prediction and a run compare term by term. Each comes from a measured rate
(:mod:`infinity.plan.rates`) times a byte or element count the engine's own accounting gives:

- compute: the model's measured forward / backward at the step's tokens (activation checkpointing
  adds one block forward per checkpointed block to backward).
- bytes: :meth:`UnitPlacement.stored_itemsizes` per stored class (so a new state format changes the
  counts here through placement, not a table of its own), chunks from :meth:`UnitPlacement.chunk_numel`,
  and the chunks kept in host memory for good from :meth:`UnitPlacement.host_resident_plan`, exactly as
  ``initialize`` lays them out. A chunk on NVMe and not resident is read and written each time the
  step walks it (an LRU cache smaller than the walk hits nothing: :mod:`infinity.zero.placement`);
  backward re-reads the parameter shards the device tier could not keep since forward. Exact for
  parameters and optimizer states (tested against the store's counters); NVMe-homed gradients whose
  dirty host copies are still there when the step reads them make the real reads smaller.
- exposed I/O: a phase's disk time (reads alone at the read rate, writes alone at the write rate,
  both at once at the at-once rates, whichever is slower) less the compute it overlaps when prefetch
  runs ahead, never less than the first unit's read (nothing runs before it to hide it behind).
- the optimizer step: a pipeline of swap-in, CPU Adam, write-back: the slower of the disk and Adam,
  plus the first chunk's read and the last one's write, at the CPU Adam rate the profile measured for
  the config's stored formats. With ``optimizer.update_at`` it runs during backward
  (``update_at`` backward; speculative is priced as the step that commits, its kept gradients
  written in backward where the host cannot hold them) or during the next forward (next_forward:
  clipping, fp16), and what it cannot hide shows in that phase's step or forward; on a CPU compute
  device Adam and the compute share the cores, so only the disk hides. The disk is one resource:
  the overlapped update's reads and writes are priced together with the phase's own (parameter
  reads, gradient writes). In backward the root unit's update comes last (the embeddings' gradient is
  final when backward ends): at least its reads and writes show in the step.
- a CPU compute device slows beside the disk: the cores and memory bus it computes on also run the I/O
  engine (checksums, copies, its threads). The part of a phase's CPU work (compute, and Adam where the
  update overlaps it) that the disk is busy runs the profile's ``contention`` ``slowdown`` times slower
  (1.30-1.43 measured here: a bf16 probe beside reads and writes at once).
- communication (world size > 1): each collective's bytes at the profile's algorithm bandwidth for
  its per-unit size, exposed in full (gloo runs on the cores the compute uses).
- unattributed: host copies the engine makes itself (gradient folding into flat buffers, store
  copies between tiers) at the memcpy rate; at stages 2-3 on a CPU device each unit's full gradient
  is a new block, fresh memory where it is above the mmap threshold
  (:func:`infinity.store.host_malloc.mmap_threshold`) and larger than the host block cache keeps
  (:mod:`infinity.store.host_cache`), so its first copies run at the profile's fresh-memory rate
  (their page faults and zeroing).

Peak RSS is :func:`infinity.estimate.peak_rss.predict_peak_rss`'s terms (the bound ``infinity estimate``
prints, kept as ``rss_bound``) with the store's tiers at the occupancy the engine reaches instead of
their budgets (:func:`_expected_rss`), and the activations measured with the compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from infinity.config import Config
from infinity.plan.rates import adam_mode
from infinity.estimate.peak_rss import RssBound, predict_peak_rss
from infinity.store import Tier, host_cache
from infinity.store.host_malloc import GLIBC_MAX_MMAP_THRESHOLD, mmap_threshold
from infinity.zero.engine import DTYPES
from infinity.zero.placement import OPTIMIZER_CLASSES, RESIDENT_RESERVE_JOBS, Placement, UnitPlacement, chunk_bounds
from infinity.zero.stage import StagePolicy
from infinity.zero.stats import PHASES, TERMS
from infinity.zero.units import TensorClass

__all__ = ["Layout", "Prediction", "predict", "tier_traffic"]


@dataclass(frozen=True)
class Layout:
    """What the model looks like to the engine at one (stage, world size): the units as ``initialize``
    cuts them (on the meta device), the largest single parameter, and the training process's RSS before
    ``initialize`` (the activations are the compute's: :meth:`ComputeRates.activation_bytes`)."""

    units: list
    largest_param_numel: int
    baseline_bytes: int


@dataclass
class Prediction:
    """One candidate's predicted step. ``phases[phase][term]`` in seconds (terms:
    :data:`infinity.zero.stats.TERMS`); ``rss``: the peak RSS bound by term; ``moved_bytes``: per tier pair
    per step; ``notes``: what the model assumed."""

    phases: dict
    rss: RssBound
    moved_bytes: dict
    notes: list = field(default_factory=list)
    rss_bound: RssBound | None = None     # the upper bound infinity estimate prints (tiers at their budgets)

    @property
    def step_s(self) -> float:
        return sum(self.phases[p][t] for p in PHASES for t in TERMS)

    def totals(self) -> dict:
        return {t: sum(self.phases[p][t] for p in PHASES) for t in TERMS}

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "phases": self.phases, "totals": self.totals(),
                "peak_rss": self.rss.to_dict(), "peak_rss_bound": self.rss_bound.to_dict() if self.rss_bound else None,
                "moved_bytes": self.moved_bytes, "notes": self.notes}


def _disk_s(read_bytes: float, write_bytes: float, rates) -> float:
    """Seconds of disk for a phase: each direction alone at its rate; both at once at the at-once rates."""
    if read_bytes and write_bytes:
        return max(read_bytes / (rates.mixed_read_gbps * 1e9), write_bytes / (rates.mixed_write_gbps * 1e9))
    return read_bytes / (rates.read_gbps * 1e9) + write_bytes / (rates.write_gbps * 1e9)


def _beside_disk(cpu_s: float, disk_s: float, slowdown: float) -> float:
    """``cpu_s`` of work on a CPU device beside ``disk_s`` of the I/O engine streaming: the part of it the
    disk is busy runs ``slowdown`` times slower (the profile's ``contention``)."""
    if cpu_s <= 0 or slowdown <= 1.0:
        return cpu_s
    return cpu_s + (slowdown - 1.0) * min(cpu_s, disk_s)


def unit_placement(layout: Layout, config: Config) -> UnitPlacement:
    """The config's placement handed the layout's units, the stage policy and the stored itemsizes."""
    return Placement.from_config(config).of(layout.units, StagePolicy.of(config.zero.stage),
                                            DTYPES[config.precision.param_dtype].itemsize,
                                            DTYPES[config.precision.reduce_dtype].itemsize)


def tier_traffic(layout: Layout, config: Config, host_bytes: int) -> dict:
    """Bytes per step by class and direction, per rank: ``{"read": {phase: bytes}, "write": {phase: bytes},
    "moved": {"nvme->host": .., ...}, "first_read": bytes, "chunk": (read, write) bytes of one
    optimizer chunk}``, from the placement's own accounting and host-resident plan."""
    stage = config.zero.stage
    p_size = DTYPES[config.precision.param_dtype].itemsize
    r_size = DTYPES[config.precision.reduce_dtype].itemsize
    placement = unit_placement(layout, config)
    units = layout.units
    sizes = placement.stored_itemsizes()
    chunk = placement.chunk_numel()
    plan = {}
    if placement.any_offload:
        plan = placement.host_resident_plan(placement.resident_room(host_bytes))
    on_disk = {cls: 0 for cls in TensorClass}   # bytes homed on NVMe and not resident, per class
    root_param = 0
    root_job = {"states": 0, "grads": 0, "write": 0}   # the root unit's update: its gradient is final last
    chunk_read = chunk_write = 0
    for u in units:
        kept = plan.get(u.index, frozenset())
        for c, (lo, hi) in enumerate(chunk_bounds(u.shard_numel, chunk)):
            one = {cls: n * (hi - lo) for cls, n in sizes.items()
                   if placement.home(cls) is Tier.NVME and (cls, c) not in kept}
            for cls, n in one.items():
                on_disk[cls] += n
            job_read = sum(n for cls, n in one.items() if cls in OPTIMIZER_CLASSES or cls is TensorClass.GRAD)
            job_write = sum(n for cls, n in one.items() if cls in OPTIMIZER_CLASSES or cls is TensorClass.PARAM)
            if u.is_root:
                root_param += one.get(TensorClass.PARAM, 0)
                root_job["grads"] += one.get(TensorClass.GRAD, 0)
                root_job["states"] += job_read - one.get(TensorClass.GRAD, 0)
                root_job["write"] += job_write
            chunk_read, chunk_write = max(chunk_read, job_read), max(chunk_write, job_write)
    params = on_disk[TensorClass.PARAM]
    states = sum(on_disk[c] for c in OPTIMIZER_CLASSES)
    grads = on_disk[TensorClass.GRAD]
    deferred = placement.defer_grad_writes and grads > 0
    # the root unit is the step's last job: its new parameter shard is still in host memory when the next
    # forward gathers it first, so its read is a hit; the first block's read is the first one exposed
    first_unit = next((u for u in units if not u.is_root), None)
    first = 0
    if first_unit is not None and TensorClass.PARAM in sizes and placement.params is Tier.NVME:
        first = min(first_unit.shard_numel, chunk) * p_size
    # stage 3 with stored parameters: forward brings every shard to the device tier; backward walks the units
    # in reverse, so the device tier (LRU) still holds the last ones forward used and misses the rest
    moved = {}
    again = 0
    if placement.params is not None and placement.policy.shard_params:
        shard_param = sum(u.shard_numel for u in units) * p_size
        root_shard = sum(u.shard_numel for u in units if u.is_root) * p_size
        device_room = config.tiers.device_bytes if isinstance(config.tiers.device_bytes, int) else shard_param
        miss = max(0, shard_param - root_shard - max(device_room - root_shard, 0)) \
            if config.zero.reshard_after_forward else 0
        moved["host->device"] = shard_param + miss
        if shard_param > root_shard:
            again = int(miss * (params - root_param) / (shard_param - root_shard))
    # a speculative update keeps its gradients for a redo: written home in backward as each update is done
    # where the host cannot hold them all (UnitPlacement.writes_kept_grads), else held (nothing moves)
    kept_written = deferred and placement.writes_kept_grads(plan, host_bytes)
    read = {"forward": params - root_param,                      # every unit once; the root stays gathered
            "backward": again,
            "step": states + (0 if deferred else grads)}
    write = {"forward": 0, "backward": grads if kept_written or not deferred else 0, "step": states + params}
    moved.update({"nvme->host": sum(read.values()), "host->nvme": sum(write.values())})
    if placement.grads is not None and stage >= 2:
        moved["device->host"] = sum(u.shard_numel for u in units) * r_size
    return {"read": read, "write": write, "moved": {k: v for k, v in moved.items() if v},
            "first_read": first, "chunk": (chunk_read, chunk_write), "plan": plan,
            "root_job": (root_job["states"] + (0 if deferred else root_job["grads"]), root_job["write"])}


def _comm_s(layout: Layout, config: Config, world: int, rates) -> dict:
    """Seconds of collectives per phase at this rank (exposed in full: module doc)."""
    out = dict.fromkeys(PHASES, 0.0)
    if world <= 1:
        return out
    stage = config.zero.stage
    policy = StagePolicy.of(stage)
    p_size = DTYPES[config.precision.param_dtype].itemsize
    r_size = DTYPES[config.precision.reduce_dtype].itemsize
    units = layout.units
    full_params = sum(u.padded_numel for u in units) * p_size
    full_grads = sum(u.padded_numel for u in units) * r_size
    n = len(units)
    if policy.shard_params:
        out["forward"] = rates.collective_s("all_gather", full_params, n)
        again = sum(u.padded_numel for u in units if not u.is_root) * p_size
        out["backward"] = rates.collective_s("all_gather", again, max(n - 1, 1)) if config.zero.reshard_after_forward else 0.0
    if stage == 0:
        out["backward"] += rates.collective_s("all_reduce", full_grads, max(1, full_grads // config.zero.bucket_bytes))
    elif stage >= 2:
        out["backward"] += rates.collective_s("reduce_scatter", full_grads, n)
    else:   # stage 1: reduce-scatter at the step
        out["step"] += rates.collective_s("reduce_scatter", full_grads, n)
    if policy.gather_after_step:
        out["step"] += rates.collective_s("all_gather", full_params, n)
    return out


def _fresh_grad_bytes(units, config: Config, placement: Placement, r_size: int) -> int:
    """Bytes of the stage 2-3 full gradients backward makes new on the host each step (each unit's,
    :meth:`infinity.zero.grads.GradReducer._new_full_grad`) that are mapped fresh rather than reused:
    those at or above the mmap threshold, less those the host block cache keeps for the next unit (one
    no larger than its cap, :mod:`infinity.store.host_cache`)."""
    if StagePolicy.of(config.zero.stage).grads_in_arena:
        return 0
    threshold = mmap_threshold(config.tiers.malloc_mmap_threshold, placement.any_offload)
    threshold = GLIBC_MAX_MMAP_THRESHOLD if threshold is None else threshold
    cap = host_cache.cap_of(config.tiers, placement.any_offload)
    return sum(u.padded_numel * r_size for u in units if threshold <= u.padded_numel * r_size and
               u.padded_numel * r_size > cap)


def predict(layout: Layout, config: Config, compute, rates, world: int, budgets: dict,
            device_is_host: bool, max_live_bytes: int) -> Prediction:
    """The predicted step of ``config`` (module doc). ``budgets``: resolved ``{Tier: bytes}``;
    ``compute``: :class:`~infinity.plan.rates.ComputeRates` in the config's compute dtype."""
    stage = config.zero.stage
    p_size = DTYPES[config.precision.param_dtype].itemsize
    r_size = DTYPES[config.precision.reduce_dtype].itemsize
    placement = unit_placement(layout, config)
    units = layout.units
    shard_numel = sum(u.shard_numel for u in units)
    full_numel = sum(u.padded_numel for u in units)
    checkpointed = config.zero.checkpointed_units(compute.blocks)
    traffic = tier_traffic(layout, config, budgets[Tier.HOST])
    read, write = traffic["read"], traffic["write"]
    prefetching = config.prefetch.bytes > 0
    memcpy = rates.memcpy_gbps * 1e9
    comm = _comm_s(layout, config, world, rates)
    notes = []

    compute_f_alone, compute_b_alone = compute.forward_s(), compute.backward_s(checkpointed)
    # zero.activation_offload: the blocks' saves leave in forward and come back in backward, each way one
    # copy through host memory; on NVMe also written, then read back ahead of use (prefetch.bytes)
    act_tier = config.zero.activation_offload
    act_moved = compute.offloaded_bytes(checkpointed) if act_tier != "none" else 0
    act_disk = act_moved if act_tier == "nvme" else 0
    phases = {p: dict.fromkeys(TERMS, 0.0) for p in PHASES}
    # a CPU device computes on the cores (and memory bus) the I/O engine uses: slowed while the disk streams
    slowdown = (rates.compute_slowdown or 1.0) if device_is_host else 1.0
    if device_is_host and rates.compute_slowdown is None and placement.any_offload:
        notes.append("the profile has no contention section: a CPU device's compute beside the disk is priced "
                     "as if alone (run `infinity profile` again)")

    # forward: parameter reads, hidden behind compute by the prefetcher except the first unit's
    disk_f = _disk_s(read["forward"], 0, rates)
    first_s = _disk_s(traffic["first_read"], 0, rates)
    # the activations' writes share the disk; they are behind compute but for the last block's
    disk_fa = _disk_s(read["forward"], act_disk, rates)
    compute_f = _beside_disk(compute_f_alone, disk_fa, slowdown)
    exposed_f = max(disk_f - compute_f, min(first_s, disk_f)) if prefetching else disk_f
    exposed_f = max(exposed_f, disk_fa - compute_f)
    gathers = traffic["moved"].get("host->device", 0)
    phases["forward"].update(compute_s=compute_f, io_wait_s=exposed_f, comm_s=comm["forward"],
                             unattributed_s=gathers / 2 / memcpy + act_moved / memcpy)

    # backward: parameter reads again, gradient writes; gradients folded into flat buffers
    disk_b = _disk_s(read["backward"] + act_disk, write["backward"], rates)
    compute_b = _beside_disk(compute_b_alone, disk_b, slowdown)
    exposed_b = max(disk_b - compute_b, 0.0) if prefetching or not read["backward"] else disk_b
    # the last block's saves are read before its backward, with nothing yet to hide behind
    exposed_b += _disk_s(compute.block_offload_bytes(checkpointed), 0, rates) if act_disk else 0.0
    fresh = _fresh_grad_bytes(units, config, placement, r_size) if device_is_host else 0
    if fresh and rates.memcpy_fresh_gbps is None:
        notes.append("the profile has no fresh-memory copy rate: new gradient blocks are priced at the memcpy "
                     "rate, their page faults uncounted (run `infinity profile` again)")
    fresh_gbps = rates.memcpy_fresh_gbps or rates.memcpy_gbps
    fold = full_numel * r_size + traffic["moved"].get("device->host", 0) - fresh
    phases["backward"].update(compute_s=compute_b, io_wait_s=exposed_b, comm_s=comm["backward"],
                              unattributed_s=fold / memcpy + fresh / (fresh_gbps * 1e9) + gathers / 2 / memcpy
                              + act_moved / memcpy)

    # the step: swap-in -> Adam -> write-back, pipelined
    mode = adam_mode(config)
    if not rates.has_adam_mode(mode):   # a profile older than the format: the fp32 update's rate, said
        notes.append(f"CPU Adam with states {mode} not in the profile: the fp32 rate is used "
                     "(run `infinity profile` again)")
        mode = "fp32/fp32"
    adam = rates.adam_s(shard_numel, mode)
    disk_s = _disk_s(read["step"], write["step"], rates)
    chunk_read, chunk_write = traffic["chunk"]
    fill = _disk_s(chunk_read, 0, rates) + _disk_s(0, chunk_write, rates)
    pipeline_io = max(disk_s - adam, 0.0) + fill if disk_s else 0.0
    step = phases["step"]
    step["comm_s"] = comm["step"]
    timing = config.update_schedule()
    if timing.overlapped and placement.optimizer is not None:
        # backward (and a speculation that commits): the pipeline starts as each unit's gradient is final,
        # and hides behind backward; next_forward: step() launches it and the next forward waits per unit,
        # so it hides behind forward (a third of the compute, not two) and what is left shows in forward.
        # On a CPU device Adam takes the cores that phase computes on (it shows as its compute), and only
        # the disk hides.
        in_backward = timing.in_backward
        if timing.spares:
            notes.append("speculative: the step that commits; one that clips (or overflows) redoes its update "
                         "after backward, unhidden, and the next steps run as next_forward until norms calm")
        name = "backward" if in_backward else "forward"
        host = phases[name]
        waits = step if in_backward else host
        # in backward the root unit's gradient (the embeddings: used first in forward) is final last, so its
        # update's reads and writes run after backward, with nothing left to hide behind
        tail = _disk_s(*traffic["root_job"], rates) if in_backward else 0.0
        tail = max(tail, _disk_s(0, chunk_write, rates))
        # one disk: the update's reads and writes share it with the phase's own (its exposed part counted)
        disk_all = _disk_s(read[name] + read["step"], write[name] + write["step"], rates) + fill
        own_exposed = host["io_wait_s"]
        if device_is_host:
            alone = (compute_b_alone if in_backward else compute_f_alone) + adam
            host["compute_s"] = _beside_disk(alone, disk_all, slowdown)
            notes.append(f"overlap ({timing.at}) on a CPU device: Adam shares the cores with the compute")
            waits["io_wait_s"] += max(disk_all - own_exposed - host["compute_s"], tail)
        else:
            busy = host["compute_s"]
            left = max(max(adam, disk_all - own_exposed - fill) + fill - busy, 0.0)
            waits["adam_s"] += min(adam, left)
            waits["io_wait_s"] += max(left - min(adam, left), tail)
    else:
        step["adam_s"] = adam
        step["io_wait_s"] = pipeline_io
    step["unattributed_s"] = (read["step"] + write["step"]) / memcpy / 4   # staging copies beside the disk

    activations = compute.activation_bytes(checkpointed, act_tier)
    bound = predict_peak_rss(layout.baseline_bytes, units, placement, stage, p_size, r_size, budgets,
                             device_is_host, max_live_bytes, activations, layout.largest_param_numel,
                             host_cache.cap_of(config.tiers, placement.any_offload))
    rss = _expected_rss(bound, traffic, placement, budgets, device_is_host, layout.largest_param_numel,
                        config.prefetch.bytes,
                        compute.saved.backward_peak(checkpointed, act_tier) if device_is_host else 0)
    moved = dict(traffic["moved"])
    if act_moved:
        held = compute.saved.in_host(checkpointed, act_tier, config.prefetch.bytes)
        rss = replace(rss, host_tier_bytes=min(budgets[Tier.HOST], rss.host_tier_bytes + held))
        bound = replace(bound, host_tier_bytes=budgets[Tier.HOST])
        for pair in ("device->host", "host->device") + (("host->nvme", "nvme->host") if act_disk else ()):
            moved[pair] = moved.get(pair, 0) + act_moved
    if prefetching is False and read["forward"]:
        notes.append("prefetch off: every parameter read is exposed")
    if rates.lower_bound:
        notes.append("the profile's figures are lower bounds (a small --bytes): I/O predictions read high")
    return Prediction(phases=phases, rss=rss, moved_bytes=moved, notes=notes, rss_bound=bound)


def _expected_rss(bound: RssBound, traffic: dict, placement: UnitPlacement, budgets, device_is_host: bool,
                  largest_param_numel: int, prefetch_bytes: int, activations_at_peak: int = 0) -> RssBound:
    """The bound's terms at the occupancy the engine reaches rather than their worst case: gradient buffers
    with one reduction in flight (the largest parameter's ``.grad`` beside the largest unit's full gradient
    and, with more than one rank, its shard at stages 2-3; its shard at stage 1); stage 3's gathered
    parameters as the forward holds them (the root, the unit computing and the whole units
    ``prefetch.bytes`` fetches ahead, within the cap); the slack recomputed on those; with a store, host =
    homed shards + resident chunks + the step's working room (the pipeline's jobs in flight,
    :data:`~infinity.zero.placement.RESIDENT_RESERVE_JOBS` of them) + what the host tier keeps clean between
    its uses in one step (stage 3's parameter shards, read in forward and again in backward; gradients
    written home in backward and read by the step), within the budget; and the device tier (RAM on a CPU
    device) empty unless it holds stage-3 parameter copies.
    Measured at GPT-2 2.7B (3 GiB host, all on NVMe): host tier 3.0 GiB (the budget), gathered 0.54 GiB,
    gradient buffers 0.39 GiB, where the bound's worst cases are 3.0 / 1.0 / 2.7 GiB; at GPT-2 medium (1 GiB
    host, stage 2, gradients and states on NVMe) the host tier reached its budget too."""
    from infinity.estimate.peak_rss import SLACK_FIXED_BYTES, SLACK_FRACTION

    units, stage = placement.units, placement.policy.stage
    p_size, r_size = placement.param_itemsize, placement.reduce_itemsize
    grads = 0
    if device_is_host:
        one_rank = all(u.shard_numel >= u.padded_numel for u in units)
        largest_full = max(u.padded_numel for u in units) * r_size
        largest_shard = max(u.shard_numel for u in units) * r_size
        # one rank: the mean is the full gradient itself, no second buffer (GradReducer)
        grads = largest_param_numel * p_size + (largest_full + (0 if one_rank else largest_shard) if stage >= 2
                                                else largest_shard if stage == 1 else 0)
        grads = min(grads, bound.grad_buffers_bytes)
    gathered = bound.gathered_params_bytes
    if stage == 3 and gathered:
        root = sum(u.padded_numel for u in units if u.is_root) * p_size
        largest = max((u.padded_numel for u in units if not u.is_root), default=0) * p_size
        ahead = largest * (prefetch_bytes // largest) if largest else 0
        gathered = min(gathered, root + largest + ahead)
    activations = max(bound.activation_bytes, activations_at_peak)
    slack = SLACK_FIXED_BYTES + int(SLACK_FRACTION * (gathered + grads + activations))
    bound = replace(bound, grad_buffers_bytes=grads, gathered_params_bytes=gathered, slack_bytes=slack,
                    activation_bytes=activations)
    if not placement.any_offload:
        return bound
    homed, _, _, _, chunk_job = placement.host_working_set()
    resident = placement.resident_bytes(traffic["plan"])
    # kept clean in the host tier's cache until read again in the same step: stage 3's parameter shards (read in
    # forward, again in backward) and gradients written home in backward (read by the step)
    cached = (traffic["read"]["forward"] if stage == 3 else 0) + traffic["write"]["backward"]
    host = min(budgets[Tier.HOST], homed + resident + RESIDENT_RESERVE_JOBS * chunk_job + cached)
    device = bound.device_tier_bytes
    if not (placement.policy.shard_params and placement.params is not None) or not device_is_host:
        device = 0
    return replace(bound, host_tier_bytes=host, device_tier_bytes=device)

