"""Host <-> device copies that run off the caller's thread.

One worker thread does every copy, so the store's completions look the same on
both paths: a ``Future`` that is done when the destination holds the bytes.

On CUDA the copy is issued non-blocking on a side stream, so it overlaps the
compute stream, and the worker waits on an event recorded after it. On CPU (the
"device" is plain memory) the worker simply copies; that keeps the tier
machinery genuinely asynchronous there too, so races show up in CPU tests.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch

__all__ = ["DeviceCopier"]


class DeviceCopier:
    """Copies between equally shaped tensors on a worker thread; ``copy()`` returns a Future[None]."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if self.cuda else None  # CUDA-only: the side stream
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinity-store-copy")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> cf.Future:
        """Copy ``src`` into ``dst`` once ``after`` (a CUDA event; default: one recorded now on the
        caller's current stream) has passed. Done when ``dst`` holds the bytes."""
        ready = after
        if self.cuda and ready is None:
            # CUDA-only: the side stream must not read ``src`` (or overwrite ``dst``) before the
            # kernels the caller already queued on its stream have finished with them.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return self._pool.submit(self._run, dst, src, ready)

    def _run(self, dst: torch.Tensor, src: torch.Tensor, ready) -> None:
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):   # CUDA-only from here on
            self._stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        # The store marks the copy resident (and may free the source) when this returns,
        # so it must not return before the bytes have landed.
        done.synchronize()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
