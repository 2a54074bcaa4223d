"""Where each step's peak RSS went: the engine's per-step memory report.

Off until ``engine.memory.enable()``; then, at the end of every optimizer step,
:meth:`StepMemory.end_step` reads the process's peak RSS over the step and puts
beside it what the engine knows it held, each part at its own peak during the
step. ``engine.memory_report()`` returns the last step's dict (None before the
first measured step). Keys, all bytes unless said otherwise:

======================  ========================================================================
key                     what
======================  ========================================================================
peak_rss_bytes          the process's peak RSS since the last step ended (None: not measurable)
peak_rss_source         ``"VmHWM"``: Linux's high-water mark, reset after each step through
                        ``/proc/self/clear_refs``; ``"ru_maxrss"`` where that file cannot be
                        written: exact only when the whole-process peak rose during the step,
                        else ``peak_rss_bytes`` is None
run_peak_rss_bytes      the most ``peak_rss_bytes`` since ``enable()``
rss_bytes               RSS when the step ended
baseline_rss_bytes      RSS when ``initialize`` began building the engine (before any shard;
                        with torch's runtime only if it ran before: :func:`warm_torch`)
store_host_bytes        the store's host buffers (in use + cached), peak; None: no store
store_device_bytes      the store's device tier, peak (RAM on CPU, where its pool's cached buffers count too); None: no store
gathered_params_bytes   stage 3: full parameters gathered at once, peak (``live_peak_bytes``, what
                        ``prefetch.max_live_bytes`` caps; on a CPU device, or the memory the full
                        buffers hold with what :mod:`~infinity.zero.storage_pool` keeps for the next
                        gathers, where more); 0 at stages 0-2 (their full parameters are resident)
grad_buffers_bytes      full gradients waiting for reduction and reduction outputs, peak at once
                        (stages 0-1's gradient arena is resident instead)
resident_bytes          model state in engine memory when the step ended: shards not in the
                        store, stages 0-2's full parameters, stages 0-1's gradient arena, hpZ's
                        secondary shards (``engine.resident_bytes()`` without the store)
host_cache_bytes        freed large blocks :mod:`~infinity.store.host_cache` kept for reuse, peak
                        (host RAM on any device; 0 when the cache is off)
activation_bytes        tensors autograd saved in the model's forward, peak (unique storages;
                        parameters excluded); None: ``enable(activations=False)``
accounted_bytes         baseline + the parts above that live in host RAM (on CUDA only the
                        store's host buffers and the host cache; the rest is device memory)
other_bytes             ``peak_rss_bytes - accounted_bytes``: allocator slack, autograd's
                        transient gradients and temporaries, the optimizer's fp32 scratch,
                        torch's runtime growth; None when the peak is unknown
device_is_host          whether the compute device's memory is host RAM (CPU)
device_peak_bytes       CUDA: the most device memory torch's allocator had handed out during the
                        step (``torch.cuda.max_memory_allocated``, reset each step); None on CPU
device_reserved_bytes   CUDA: the most it had reserved from the driver (allocated + cached
                        blocks, ``max_memory_reserved``): what the device budget's slack must
                        cover beyond the parts above; None on CPU
======================  ========================================================================

The parts peak at different moments of the step, so ``accounted_bytes`` is an
upper bound on what was accounted at the moment of the RSS peak, and
``other_bytes`` can come out negative when two large parts never coexist.

What "activations" counts: tensors saved for backward inside the model's
forward (the root module's forward hooks push the counting hooks and pop them
again), so a loss computed outside the model is not counted, and with
``zero.activation_checkpointing`` the checkpointed units' tensors are held by
the checkpoint, not counted (they land in ``other_bytes``). Cost when on: one
small Python object and a dict update per saved tensor.

Enabling changes a process-wide figure: each step's reset of the high-water
mark makes ``VmHWM`` and ``getrusage().ru_maxrss`` read by anyone else the
peak since the last step, not since the process started (``run_peak_rss_bytes``
keeps the run's). Do not enable it where something else reads them for the
whole run.
"""

from __future__ import annotations

import re
import resource
import sys
import threading

import psutil
import torch

from infinity.store import host_cache

__all__ = ["StepMemory", "SavedTensorMeter", "rss_bytes", "reset_peak_rss", "read_peak_rss", "warm_torch",
           "take_device_peak"]

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def rss_bytes() -> int:
    """The process's resident set size now."""
    now = _status_kib("VmRSS")
    return now if now is not None else psutil.Process().memory_info().rss


def warm_torch() -> None:
    """Run a few-kB model's forward, backward and AdamW step. Torch's runtime (autograd engine, kernel
    libraries, thread pools) loads on first use, ~85 MiB of RSS on a 2-core CPU machine: warmed before
    ``initialize``, it belongs to the baseline instead of showing up as the first step's growth. The
    global RNG is left as it was (the caller's seeded weights do not change)."""
    with torch.random.fork_rng(devices=[]):
        model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64))
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 64, (2, 8))
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()


def take_device_peak(device: torch.device) -> tuple[int | None, int | None]:
    """(peak allocated, peak reserved) device bytes since the last call, then start the next window;
    (None, None) where the device is not CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, None
    # CUDA-only: the caching allocator's high-water marks for this device
    peak = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # Linux reports KiB, macOS bytes


def reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark to its RSS now (Linux ``clear_refs`` 5); False where
    that is not allowed (not Linux, or the file is not writable)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def read_peak_rss() -> int:
    """The RSS high-water mark: ``VmHWM`` (since the last :func:`reset_peak_rss`), else ``ru_maxrss``."""
    peak = _status_kib("VmHWM")
    return peak if peak is not None else _ru_maxrss_bytes()


class _Saved:
    """What autograd keeps for one saved tensor while counting: the tensor, and a release on drop."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):   # the graph holding it was freed (its backward ran, or it was dropped)
        self.meter._drop(self.key)


class SavedTensorMeter:
    """Bytes of the tensors autograd holds for backward: live now and the peak since :meth:`take_peak`.

    Counted per storage (views of one storage count once, and what keeps the storage alive is the
    whole storage); parameters and views of them are not counted (they are the gathered or resident
    parameters). Install with ``torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)``.
    """

    def __init__(self):
        # graphs can be freed on autograd's device threads; reentrant: a collection inside pack may drop one
        self._lock = threading.RLock()
        self._storages: dict = {}       # storage key -> [bytes, saved tensors holding it]
        self.live_bytes = 0
        self.peak_bytes = 0

    def pack(self, tensor: torch.Tensor):
        base = tensor._base if tensor._base is not None else tensor
        if base.is_leaf and base.requires_grad:   # a parameter (or a view of one): not an activation
            return tensor
        try:
            storage = tensor.untyped_storage()
            # the StorageImpl: its address cannot be reused while our _Saved keeps the tensor alive
            key, nbytes = storage._cdata, storage.nbytes()
        except (RuntimeError, NotImplementedError):   # a wrapper subclass without one storage (DTensor)
            key, nbytes = ("tensor", id(tensor)), tensor.numel() * tensor.element_size()
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                entry = self._storages[key] = [nbytes, 0]
                self.live_bytes += entry[0]
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            entry[1] += 1
        # detached: the graph rejoins an unpacked output to its node itself. Held whole, an output saved by its
        # own node would hold that node's grad_fn: a cycle through C++ that gc cannot see, so a forward never
        # followed by backward kept its graph (activations and the parameters it saved) for good
        return _Saved(tensor.detach(), self, key)

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _drop(self, key) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._storages[key]
                self.live_bytes -= entry[0]

    def take_peak(self) -> int:
        """The peak since the last call; the next window starts from what is live now."""
        with self._lock:
            peak, self.peak_bytes = self.peak_bytes, self.live_bytes
        return peak


class StepMemory:
    """The engine's per-step memory report (module doc), built with the parts whose peaks it reads:
    ``store`` (None: nothing offloaded) and ``grads`` (the gradient path's buffer peak);
    ``baseline_rss_bytes`` is the RSS the engine read before building any shard; ``device``: the
    compute device (the CPU: device-side parts are in the RSS too; CUDA: its peak is read per step)."""

    def __init__(self, baseline_rss_bytes: int, store, grads, device: torch.device):
        self.baseline_rss_bytes = baseline_rss_bytes
        self.store, self.grads, self.device = store, grads, device
        self.device_is_host = device.type == "cpu"
        self.enabled = False
        self.meter: SavedTensorMeter | None = None
        self._hooks = None               # the pushed saved_tensors_hooks context, while a forward runs
        self._exact = False              # the high-water mark can be reset per step
        self._ru_mark = 0
        self._run_peak = None
        self.last: dict | None = None

    def enable(self, activations: bool = True) -> None:
        """Measure from now on; ``activations``: also count saved tensors (module doc, its cost).
        Resets the process's RSS high-water mark now and after each step."""
        self.enabled = True
        self.meter = SavedTensorMeter() if activations else None
        self._exact = reset_peak_rss()
        self._ru_mark = _ru_maxrss_bytes()
        self._take_windows()   # every part's window starts now

    # ------------------------------------------------------------ the forward (hooks.py's root hooks)

    def forward_begins(self) -> None:
        """Root forward pre-hook: count what this forward saves for backward."""
        if self.meter is None:
            return
        self._pop_stale()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack)
        self._hooks.__enter__()

    def forward_ends(self) -> None:
        """Root forward hook: stop counting (balanced with :meth:`forward_begins`)."""
        self._pop_stale()

    def _pop_stale(self) -> None:
        """Pop our hooks if they are on top of the stack (a forward that raised leaves them there);
        hooks pushed above ours by someone else are left alone, and ours with them."""
        if self._hooks is None:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] is self._hooks.pack_hook:
            self._hooks.__exit__(None, None, None)
        self._hooks = None

    # ------------------------------------------------------------ the step

    def end_step(self, resident_bytes: int, gathered_params_bytes: int) -> None:
        """The engine finished a step: measure, then start the next window. ``resident_bytes``: model
        state in engine memory now, outside the store; ``gathered_params_bytes``: the step's peak of
        gathered stage-3 parameters (0 at other stages)."""
        if not self.enabled:
            return
        now = rss_bytes()
        peak, source = self._peak_rss()
        if peak is not None:   # the kernel's high-water figures can trail VmRSS by a few pages
            peak = max(peak, now)
            self._run_peak = peak if self._run_peak is None else max(self._run_peak, peak)
        store = self.store.take_peak_bytes() if self.store is not None else None
        on_host = self.device_is_host
        out = {
            "peak_rss_bytes": peak, "peak_rss_source": source, "run_peak_rss_bytes": self._run_peak,
            "rss_bytes": now, "baseline_rss_bytes": self.baseline_rss_bytes,
            "store_host_bytes": store["host"] if store is not None else None,
            "store_device_bytes": store["device"] if store is not None else None,
            "gathered_params_bytes": gathered_params_bytes,
            "grad_buffers_bytes": self.grads.take_buffer_peak(),
            "resident_bytes": resident_bytes,
            "host_cache_bytes": host_cache.take_peak_bytes(),
            "activation_bytes": self.meter.take_peak() if self.meter is not None else None,
            "device_is_host": on_host,
        }
        out["device_peak_bytes"], out["device_reserved_bytes"] = take_device_peak(self.device)
        parts = ("store_device_bytes", "gathered_params_bytes", "grad_buffers_bytes", "resident_bytes",
                 "activation_bytes") if on_host else ()
        out["accounted_bytes"] = self.baseline_rss_bytes + sum(out[k] or 0 for k in ("store_host_bytes", "host_cache_bytes") + parts)
        out["other_bytes"] = peak - out["accounted_bytes"] if peak is not None else None
        self.last = out

    def _peak_rss(self) -> tuple:
        """(this window's peak RSS or None, how it was read); starts the next window."""
        if self._exact:
            peak = read_peak_rss()
            self._exact = reset_peak_rss()
            return peak, "VmHWM"
        now = _ru_maxrss_bytes()
        rose, self._ru_mark = now > self._ru_mark, now
        return (now if rose else None), "ru_maxrss"

    def _take_windows(self) -> None:
        if self.store is not None:
            self.store.take_peak_bytes()
        self.grads.take_buffer_peak()
        take_device_peak(self.device)
        if self.meter is not None:
            self.meter.take_peak()

    def report(self) -> dict | None:
        """The last measured step's report (module doc), a copy; None before one."""
        return dict(self.last) if self.last is not None else None
