"""The offloaded optimizer step: swap in -> CPU Adam -> swap out, overlapped across shards.

The step walks the shard jobs in order, as a list (``run``) or as they come
(``start`` / ``submit`` / ``finish``: the jobs of an update overlapped with
backward, which keeps the caller's thread busy). While :class:`CpuAdamW`
updates shard ``i`` on the compute thread, a swap-in thread is already bringing shard
``i+1``'s master / moments / gradient / parameter to host memory, and shard
``i-1``'s updated states and new low-precision parameter are being written home
by the store's I/O threads — all three at once. Nothing on that path writes
synchronously: a write-back is a future, waited on only at the end of the step
(so the step returns with every state home) or by the store when it needs the
buffer's room.

Gradients and parameters that stay in device memory (CUDA; e.g. stage 1-2 with
only the optimizer offloaded) cross to the host the same way, off the compute
thread: the swap-in thread starts shard ``i+1``'s device->host gradient copy on
a side stream into a pinned buffer, and the updated parameter goes back
host->device on the other lane's stream while Adam moves on to the next shard; its
``on_done`` (the all-gather) runs, in shard order, once its copy has landed, on
the caller's thread (in ``finish``): collectives never come from a pipeline thread.

Host memory is bounded twice: ``lookahead`` shards are swapped in ahead of the
one being updated, and every host copy the step brings lives in a room of the
store's host tier that the step sets aside when it starts
(:meth:`TensorStore.open_room`): the swap-in takes a shard only once the room
has space for it beside the shards not yet done, makes room from its own
finished shards' copies, and never competes with whoever else uses the host
tier meanwhile (gradient folds, stage-3 gathers). The staging buffers of
device tensors come from a pool of their own (pinned on CUDA through
``cudaHostRegister``, see :mod:`infinity.store.pinned_host`), bounded by the
lookahead rather than a budget and cut back at each step's end to the most the
step had in use at once; ``last_stats["staging_pinned_bytes"]`` says how much. Trade-off of ``lookahead``:
each step of it holds one more shard's states (16 B/element) in host memory and
hides one more shard's read latency behind compute.

Fields held in memory (tensors rather than store keys) pass through the
swap-in and write-back untouched, so in-memory and offloaded shards run the
same step; a pipeline without a store (``store=None``) takes only those.

Talks to the store only through its public methods (bring / mark_dirty / unpin
/ write_back / wait); knows nothing of ZeRO.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from infinity.optim.cpu_adam import CpuAdamW
from infinity.optim.shard_job import ShardJob
from infinity.optim.shard_update import update_blocked, update_flat
from infinity.store import StoreError, TensorStore, Tier
from infinity.store.device_copy import DeviceCopier
from infinity.store.host_pool import HostBufferPool
from infinity.store.pinned_host import CudaHostRegistrar, HostRegistrar
from infinity.trace import NULL_TRACER, Tracer

__all__ = ["AdamPipeline"]

_FIELDS = ("master", "exp_avg", "exp_avg_sq", "grad", "param_out")
_WRITTEN = ("master", "exp_avg", "exp_avg_sq", "param_out")   # the fields Adam changes
_END = object()   # the compute thread's last word on the landed-params queue
_SOURCE = "source"   # a swap-in future's name (_SOURCE, field): the old value of a speculative job's field
_STAGING_CAPACITY_BYTES = 2**62   # the staging pool's bound is the lookahead, not a byte budget


@dataclass
class _Staged:
    """A device tensor's host copy for Adam, and the copy's future."""

    host: torch.Tensor
    done: cf.Future
    buffer: torch.Tensor   # the staging pool's buffer under ``host``, given back once the copy is used


class AdamPipeline:
    """Runs one optimizer step at a time over :class:`ShardJob` s.

    Two forms, one code path: ``run(jobs, hyper)`` updates a known list (the step
    after backward); the streaming form ``start(hyper)``, ``submit(job)`` as each
    job becomes ready, ``finish()`` updates shards while the caller is still busy
    (``optimizer.update_at``: during backward). Either way the swap-in and
    the Adam compute run on two pipeline threads; ``run`` / ``finish`` wait for
    them, re-raise their error and return the step's stats.

    ``copy_cpu_tensors`` makes in-memory CPU tensors take the device path (copied through the
    :class:`DeviceCopier` as CUDA tensors are) so CPU tests exercise it; off by default.
    ``host_registrar`` page-locks the staging buffers of those copies (default: ``cudaHostRegister``
    when the tensors are on CUDA, none on CPU).
    The look-ahead's room (opened by :meth:`start`, closed when the step ends): ``job_bytes``, the host
    bytes of the largest job, asks for ``lookahead + 2`` of them (the shards ahead, the one being
    updated and one being written home) and takes at least one; ``leave_bytes`` is kept for the rest
    of the tier (what runs beside an overlapped update). ``job_bytes`` None: as much as the tier can
    free (a pipeline that has the store to itself).
    """

    def __init__(self, store: TensorStore | None, adam: CpuAdamW, lookahead: int = 1, tracer: Tracer = NULL_TRACER,
                 copy_cpu_tensors: bool = False, host_registrar: HostRegistrar | None = None,
                 job_bytes: int | None = None, leave_bytes: int = 0):
        if lookahead < 1:
            raise ValueError(f"AdamPipeline: lookahead must be >= 1 shard, got {lookahead}")
        self.store, self.adam, self.lookahead, self.tracer = store, adam, lookahead, tracer
        self.copy_cpu_tensors = copy_cpu_tensors
        self.job_bytes, self.leave_bytes = job_bytes, leave_bytes
        self._room = None            # the running step's look-ahead room in the store's host tier
        self._room_left = 0          # its bytes not promised to a job in flight
        self._copier: DeviceCopier | None = None
        self._staging: HostBufferPool | None = None   # host buffers of device tensors' copies
        self._host_registrar = host_registrar
        self._copier_lock = threading.Lock()   # made on first use, from either pipeline thread
        self._threads: list = []     # the running step's swap-in and compute threads; empty when idle
        self._progress = threading.Condition()
        self._issued = self._released = 0
        self._held: dict = {}
        self._stop = threading.Event()
        self.updates_started = 0     # shards whose update has begun in the running (or last) step
        self.updated: list = []      # names of the jobs whose update is done (running or last step)
        self.last_stats: dict = {}
        self._cuda_device = None

    @property
    def running(self) -> bool:
        """A step was started and not yet finished or aborted."""
        return bool(self._threads)

    def close(self) -> None:
        """Stop a step still running (its remaining jobs are dropped) and the device copier."""
        self.abort()
        if self._copier is not None:
            self._copier.close()   # every copy has landed: no DMA into a staging buffer from here on
            self._copier = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def run(self, jobs: list, hyper: Callable[[int], dict]) -> dict:
        """Update every job; ``hyper(group_index)`` gives ``step, lr, betas, eps, weight_decay``.

        Returns ``{"adam_s", "swap_in_wait_s", "swap_out_wait_s", "shards", "update_start_s"}``.
        """
        self.start(hyper)
        for job in jobs:
            self.submit(job)
        return self.finish()

    def start(self, hyper: Callable[[int], dict]) -> None:
        """Begin a step whose jobs come one by one through :meth:`submit`."""
        if self.running:
            raise RuntimeError("AdamPipeline.start: a step is already running; finish() it first")
        self._jobs: queue.Queue = queue.Queue()
        self._landed: queue.Queue = queue.Queue()   # (name, on_done, param) for the caller's thread, then _END
        ready: queue.Queue = queue.Queue()
        self._progress = threading.Condition()
        self._issued = self._released = 0
        self._held = {}   # key -> future of its pinned bring, until the compute thread unpins it
        self._served: set = set()     # jobs whose landing the caller's thread has handled (wait_for)
        self._job_writes: dict = {}   # job name -> its write-back futures, until wait_for waits them
        self._error: BaseException | None = None
        self.updates_started = 0
        self.updated = []
        self.last_stats = {}
        # CUDA-only: the current device is per thread; the compute thread takes the caller's
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else None
        # the swap-in thread may run ahead by `lookahead` shards; each slot is released when the
        # compute thread is done with a shard (its host copies unpinned, hence evictable once clean)
        self._slots = threading.Semaphore(self.lookahead + 1)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._swap_in, args=(self._jobs, ready), name="infinity-swap-in", daemon=True),
            threading.Thread(target=self._compute, args=(ready, hyper), name="infinity-adam", daemon=True)]
        for t in self._threads:
            t.start()
        if self.store is not None:   # before the first job; a tier that cannot give it stops the threads
            want = None if self.job_bytes is None else (self.lookahead + 2) * self.job_bytes
            try:
                self._room = self.store.open_room(Tier.HOST, "the optimizer's look-ahead", want=want,
                                                  least=self.job_bytes or 0, leave=self.leave_bytes)
            except BaseException:
                self.abort()
                raise
            self._room_left = self._room.size_bytes

    def submit(self, job: ShardJob) -> None:
        """Queue ``job`` (its gradient final) for the running step; returns at once."""
        if not self.running:
            raise RuntimeError(f"AdamPipeline.submit {job.name}: no step is running; start() one first")
        if self.store is None and any(isinstance(getattr(job, name), str) for name in _FIELDS):
            raise ValueError(f"AdamPipeline.submit {job.name}: a field is a store key but this pipeline has no store")
        # CUDA-only: a device gradient is final once the kernels queued so far on this stream have run
        job._grads_ready = _record_event() if torch.cuda.is_available() else None
        job._submitted_s = time.perf_counter()
        self._jobs.put(job)

    def finish(self) -> dict:
        """Wait until every submitted job is updated and written home; the step's stats (see :meth:`run`).
        Re-raises a pipeline thread's error (the keys it held are unpinned first)."""
        if not self.running:
            raise RuntimeError("AdamPipeline.finish: no step is running")
        self._jobs.put(None)   # end of the step's jobs
        # on_done (stage 1-2: an all-gather) runs here, on the caller's thread, as params land:
        # collectives are never issued from a pipeline thread, and they overlap the rest of the step
        try:
            while (landed := self._landed.get()) is not _END:
                self._serve(landed)
        except BaseException:
            self._halt()
            self._drain_landed()
            self._join(drop_error=True)
            raise
        self._join()
        return self.last_stats

    def wait_for(self, names) -> None:
        """On the caller's thread, during a running step: return once every job in ``names`` is updated,
        its ``on_done`` has run (the jobs before it landed first, in order) and its write-back is home.
        For a caller that uses a shard while the rest of the step runs (the next forward of an update
        launched by ``optimizer.step()``). Re-raises a pipeline thread's error; the step is then over."""
        if not self.running:
            raise RuntimeError("AdamPipeline.wait_for: no step is running")
        try:
            while not set(names) <= self._served:
                landed = self._landed.get()
                if landed is _END:   # before finish() only a failed step ends: join raises its error
                    self._halt()
                    self._jobs.put(None)   # the swap-in thread may wait for a job that will not come
                    self._join()
                    raise RuntimeError("AdamPipeline.wait_for: the step ended without the jobs "
                                       f"{sorted(set(names) - self._served)}")
                self._serve(landed)
        except BaseException:
            if self.running:
                self._halt()
                self._drain_landed()
                self._join(drop_error=True)
            raise
        with self._progress:   # the compute thread starts a job's write-back right after landing it
            while not all(n in self._job_writes for n in names) and not self._stop.is_set():
                self._progress.wait()
            writes = [f for n in names for f in self._job_writes.pop(n, [])]
        for f in writes:
            self.store.wait(f)   # the shard is home: reading it now sees the new bytes

    def _serve(self, landed) -> None:
        name, on_done, param = landed
        if on_done is not None:
            on_done(param)
        self._served.add(name)

    def abort(self) -> None:
        """Stop a running step without updating the jobs not yet begun; errors are dropped. What was
        updated stays updated (and is written home): a step cannot be undone half-way."""
        if not self.running:
            return
        self._halt()
        self._jobs.put(None)
        self._drain_landed()
        self._join(drop_error=True)

    def _drain_landed(self) -> None:
        """Skip the on_done calls still to come, up to the compute thread's end marker."""
        while self._landed.get() is not _END:
            pass

    def _join(self, drop_error: bool = False) -> None:
        threads, self._threads = self._threads, []
        for t in threads:
            t.join()
        if self._room is not None:   # what the step left cached there becomes the tier's
            self.store.close_room(self._room)
            self._room = None
        if self._error is not None:
            # the swap-in thread has exited: nothing can take a new pin while these are dropped
            self._unpin_held()
            error, self._error = self._error, None
            if not drop_error:
                raise error

    def _halt(self) -> None:
        """Unblock both threads for an early exit (error or abort)."""
        self._stop.set()
        self._slots.release()   # the swap-in thread may wait for a slot
        with self._progress:
            self._progress.notify_all()   # or for room (see _take_room)

    # ------------------------------------------------------------ the three stages

    def _compute(self, ready: queue.Queue, hyper) -> None:
        """Compute thread: update each swapped-in shard in order, start its write-back, land its param."""
        adam_s = wait_s = 0.0
        writes: list = []
        starts: list = []
        # (copy to the device or None, on_done, param) in shard order: on_done runs once the copy landed
        landing: collections.deque = collections.deque()
        try:
            if self._cuda_device is not None:
                torch.cuda.set_device(self._cuda_device)   # CUDA-only: the current device is per thread
            with torch.no_grad():   # grad mode is per thread; the update must not record a graph
                while True:
                    t0 = time.perf_counter()
                    item = ready.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    job, futures = item
                    tensors = {name: self._result(f) if f is not None else
                               (getattr(job, name) if isinstance(name, str) else job.sources[name[1]])
                               for name, f in futures.items()}
                    for name in job.sources:   # a speculative job: its fields start from their sources
                        if name in job._handover:
                            tensors[name] = self._hand_over(job, *job._handover[name], futures[(_SOURCE, name)])
                            del tensors[(_SOURCE, name)]
                        else:
                            tensors[name].copy_(tensors.pop((_SOURCE, name)))
                    t1 = time.perf_counter()
                    # time before the job was submitted is the caller's (backward), not a wait for I/O
                    wait_s += max(0.0, t1 - max(t0, job._submitted_s))
                    self.tracer.add(f"wait swap-in {job.name}", max(t0, job._submitted_s), t1, lane="compute")
                    with self._progress:
                        self.updates_started += 1
                    starts.append(t1)
                    try:
                        with self.tracer.span(f"adam {job.name}", lane="compute"):
                            out, copied = self._update(job, tensors, hyper)
                    finally:   # the staged gradients have been read (or never will be)
                        for f in futures.values():
                            if isinstance(f, _Staged):
                                self._staging.release(f.buffer)
                    with self._progress:
                        self.updated.append(job.name)
                    t2 = time.perf_counter()
                    adam_s += t2 - t1
                    landing.append((job.name, copied, job.on_done, out))
                    # a copy still in flight holds its host buffer: at most `lookahead` more of them
                    self._land(landing, keep=self.lookahead)
                    job_writes = self._swap_out(job)
                    writes.extend(job_writes)
                    with self._progress:
                        self._job_writes[job.name] = job_writes
                        self._released += 1
                        self._room_left += job._room_bytes
                        self._progress.notify_all()
                    self._slots.release()
                    # this job's host tensors go with it: the wait for the next one may be long, and the
                    # store may have freed (dropped, discarded) their buffers by then
                    item = job = futures = tensors = out = copied = None
                self._land(landing, keep=0)
            staging_pinned_bytes = 0
            if self._staging is not None:   # keep what this step had in use at once; give back the rest
                self._staging.end_window()
                staging_pinned_bytes = self._staging.stats()["pinned_bytes"]
            t3 = time.perf_counter()
            for f in writes:
                self.store.wait(f)   # the step ends with every state home (a crash after it loses nothing)
            self.last_stats = {"adam_s": adam_s, "swap_in_wait_s": wait_s,
                               "swap_out_wait_s": time.perf_counter() - t3, "shards": len(starts),
                               "update_start_s": starts, "staging_pinned_bytes": staging_pinned_bytes}
        except BaseException as e:   # noqa: BLE001 - re-raised by finish() on the caller's thread
            self._error = e
            self._halt()
            for _, copied, _, _ in landing:   # parameter copies still in flight keep their buffer until done
                if copied is not None:
                    copied.done.exception()
                    self._staging.release(copied.buffer)
        finally:
            self._landed.put(_END)

    def _swap_in(self, jobs: queue.Queue, ready: queue.Queue) -> None:
        """Swap-in thread: bring each job's stored fields to host, pinned, in order."""
        try:
            while True:
                job = jobs.get()
                if job is None:
                    ready.put(None)
                    return
                self._slots.acquire()
                if self._stop.is_set():
                    ready.put(None)   # the compute thread may be waiting for an item (abort)
                    return
                t0 = time.perf_counter()
                futures, seen = {}, {}
                # a source homed beyond the host tier: its host copy is handed over to the field's key once
                # it lands (TensorStore.hand_over), no copy and no more room; it must be clean (its home holds
                # its bytes), so a dirty one (rare: a lent copy written back late) is written home first
                job._handover = {n: (v, getattr(job, n)) for n, v in job.sources.items() if isinstance(v, str)
                                 and isinstance(getattr(job, n), str) and self.store.home(v) is not Tier.HOST}
                for src, _ in job._handover.values():
                    if self.store.is_dirty(src):
                        self.store.wait(self.store.write_back(src))
                if not self._take_room(job):
                    ready.put(None)   # stopped meanwhile (abort): the compute thread may wait for an item
                    return
                for name, value in [(n, getattr(job, n)) for n in _FIELDS] + \
                        [((_SOURCE, n), v) for n, v in job.sources.items()]:
                    if name in job._handover:
                        futures[name] = None   # filled by the hand-over of (_SOURCE, name)
                    elif isinstance(value, str):
                        # the same key twice (aliases) is brought and pinned once
                        if value not in seen:
                            # the new parameter overwrites all of the old one: claim, don't read it,
                            # unless the key also serves a field Adam reads (fp32: param is the master)
                            # and unless it holds half of a split master; a field filled from its
                            # source is overwritten whole as well
                            overwrite = name in job.sources or (
                                name == "param_out" and not job.master_is_remainder and all(
                                    getattr(job, other) != value for other in _FIELDS if other != name))
                            seen[value] = self._bring_pinned(value, overwrite)
                            with self._progress:
                                self._held[value] = seen[value]
                        futures[name] = seen[value]
                    elif name == "grad" and self._crosses(job, value):
                        futures[name] = self._stage_to_host(value, job._grads_ready)
                    else:
                        futures[name] = None
                job._keys = list(seen)
                with self._progress:
                    self._issued += 1
                self.tracer.add(f"issue swap-in {job.name}", t0, time.perf_counter(), lane="swap-in")
                ready.put((job, futures))
                job = futures = seen = value = None   # not held while this thread waits for the next job
        except BaseException as e:   # noqa: BLE001 - handed to the compute thread, which raises it
            ready.put(e)

    def _hand_over(self, job: ShardJob, src: str, dst: str, fut) -> torch.Tensor:
        """A speculative job's source ``src``, landed in host memory (pinned): its copy becomes ``dst``'s."""
        tensor = self.store.hand_over(src, dst, Tier.HOST)
        with self._progress:   # the pin moved with the copy: it is ``dst`` that is unpinned after the update
            self._held.pop(src, None)
            self._held[dst] = fut
        job._keys = [dst if k == src else k for k in job._keys]
        return tensor

    def _crosses(self, job: ShardJob, value) -> bool:
        """An in-memory device tensor of a job whose master is stored (so Adam runs on the host)."""
        on_device = isinstance(value, torch.Tensor) and (value.device.type != "cpu" or self.copy_cpu_tensors)
        return on_device and isinstance(job.master, str)

    def _stage_to_host(self, value: torch.Tensor, grads_ready) -> _Staged:
        host, buffer = self._staging_buffer(value)
        return _Staged(host, self._device_copier(value).to_host(host, value, after=grads_ready), buffer)

    def _device_copier(self, like: torch.Tensor) -> DeviceCopier:
        with self._copier_lock:
            if self._copier is None:
                self._copier = DeviceCopier(like.device)
                registrar = self._host_registrar
                if registrar is None and like.is_cuda:
                    registrar = CudaHostRegistrar(like.device)   # CUDA-only: pinned, so the copies run async
                # bounded by the lookahead (each shard in flight stages one gradient and one parameter)
                self._staging = HostBufferPool(_STAGING_CAPACITY_BYTES, registrar=registrar)
            return self._copier

    def _staging_buffer(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A host tensor shaped like the device tensor ``like`` (pinned on CUDA, so copies run async),
        and the pool buffer under it."""
        self._device_copier(like)
        nbytes = like.numel() * like.element_size()
        buffer = self._staging.acquire(nbytes)
        return buffer[:nbytes].view(like.dtype).view(like.shape), buffer

    def _result(self, f):
        if isinstance(f, _Staged):
            f.done.result()
            return f.host
        return self.store.wait(f)

    def _land(self, landing: collections.deque, keep: int) -> None:
        """Hand on_done of the finished params at the head of ``landing`` to the caller's thread, in
        order (all ranks launch their all-gathers in the same order); wait for copies while more
        than ``keep`` are in flight."""
        while landing:
            name, copied, on_done, param = landing[0]
            if copied is not None and not copied.done.done() and len(landing) <= keep:
                return
            landing.popleft()
            if copied is not None:
                try:
                    copied.done.result()
                finally:
                    self._staging.release(copied.buffer)
            # every job (wait_for follows them all), its param only for an on_done: the caller may take
            # them only in finish(), and a param held in this queue keeps its host buffer alive after
            # the store has freed it (an overlapped backward's jobs would pile up outside every budget)
            self._landed.put((name, on_done, param if on_done is not None else None))

    def _unpin_held(self) -> None:
        """After an error: drop the pins this run still holds, so the keys stay evictable and usable."""
        with self._progress:
            held, self._held = self._held, {}
        for key, fut in held.items():
            try:
                fut.result()   # the pin is taken when the bring completes; a failed bring took none
            except BaseException:   # noqa: BLE001 - the original error is what the caller sees
                continue
            try:
                self.store.unpin(key, Tier.HOST)
            except StoreError:
                pass

    def _take_room(self, job: ShardJob) -> bool:
        """Swap-in thread: wait until the look-ahead room has space for ``job``'s host copies beside the jobs
        in flight (the compute thread gives it back as it finishes each), and promise it to the job. A job
        bigger than the whole room goes alone (the store then refuses what does not fit, naming the room).
        False: the step was stopped meanwhile."""
        keys = {getattr(job, n) for n in _FIELDS if isinstance(getattr(job, n), str) and n not in job._handover} | \
            {v for v in job.sources.values() if isinstance(v, str)}   # a handed-over field takes its source's copy
        job._room_bytes = 0 if self._room is None else sum(self.store.working_bytes(k, Tier.HOST) for k in keys)
        with self._progress:
            while job._room_bytes > self._room_left and self._issued > self._released and not self._stop.is_set():
                self._progress.wait()
            self._room_left -= job._room_bytes
        return not self._stop.is_set()

    def _bring_pinned(self, key: str, overwrite: bool = False):
        """Bring ``key`` to host, pinned, in the look-ahead room (``overwrite``: claimed, its old bytes not
        read). The room holds this job beside the ones in flight (:meth:`_take_room`): the store makes
        space by dropping copies of finished jobs, waiting for their writes home if it must."""
        move = self.store.claim if overwrite else self.store.bring
        return move(key, Tier.HOST, pin=True, within=self._room)

    def _update(self, job: ShardJob, t: dict, hyper) -> tuple:
        """Update one shard; returns the parameter as it lives in its final place, and the future
        of its copy there (None when Adam wrote it in place).

        Host-resident masters go through CpuAdamW. A master kept in device memory (optimizer
        not offloaded, CUDA) is updated where it lives by torch's fused AdamW kernel, as CpuAdamW
        runs it on the host (:func:`~infinity.optim.cpu_adam.device_adamw_`); a tensor on the
        other side of the master (a device gradient, a device parameter) is copied across.
        """
        master = t["master"]
        dev = master.device
        if dev.type != "cpu" and job._grads_ready is not None:
            # CUDA-only: this thread's stream is not the one backward ran on; without the wait
            # the update could read the gradient before its kernels have written it
            torch.cuda.current_stream(dev).wait_event(job._grads_ready)
        grad = t["grad"] if t["grad"].device == dev else t["grad"].to(dev)
        final = t["param_out"]
        to_device = self._crosses(job, job.param_out)
        if final is None or (final.device == dev and not to_device):
            out = final
        else:
            if to_device:
                out, staging = self._staging_buffer(final)
            else:
                out = torch.empty(final.shape, dtype=final.dtype, device=dev)
            if job.master_is_remainder:
                out.copy_(final)   # the parameter is half of the master: Adam reads it (CUDA: blocking)
        (update_blocked if job.moments_blocked else update_flat)(self.adam, job, t, master, grad, out, hyper)
        if to_device:
            # off the compute thread; the copy's closure holds `out` alive until it has landed
            return final, _Staged(out, self._device_copier(final).to_device(final, out), staging)
        if final is not None and out is not final:
            # device master -> host-stored parameter (optimizer kept on the device): blocking
            final.copy_(out)
        return (final if final is not None else master), None

    def _swap_out(self, job: ShardJob) -> list:
        """Mark the changed copies dirty, unpin everything, start the write-backs (not waited here)."""
        written = {getattr(job, name) for name in _WRITTEN if isinstance(getattr(job, name), str)}
        futures = []
        for key in job._keys:
            if key in written:
                # dirty is marked before unpinning so no eviction can drop the new bytes unsaved
                self.store.mark_dirty(key, Tier.HOST)
            self.store.unpin(key, Tier.HOST)
            with self._progress:
                self._held.pop(key, None)
            if key in written and self.store.home(key) is not Tier.HOST:
                t0 = time.perf_counter()
                # evict writes the new bytes home, then frees the host copy (its buffer is reused at once)
                f = self.store.evict(key, Tier.HOST) if key in job.drop else self.store.write_back(key)
                if self.tracer.recording:
                    f.add_done_callback(lambda _f, k=key, t0=t0: self.tracer.add(
                        f"write {k}", t0, time.perf_counter(), lane="swap-out"))
                futures.append(f)
        for key in job.discard:
            if key in job._keys and self.store.home(key) is not Tier.HOST:
                self.store.discard(key, Tier.HOST)
        for key in job.write_home:
            if key in job._keys and self.store.home(key) is not Tier.HOST:
                try:   # written home first if it is the newest copy, then freed
                    futures.append(self.store.evict(key, Tier.HOST))
                except StoreError:   # pinned by another user: left to the cache (spilled if room runs short)
                    pass
        return futures


def _record_event():
    """CUDA-only: an event recorded now on the current stream."""
    event = torch.cuda.Event()
    event.record()
    return event
