"""Pinned host memory that keeps its budget: page-locked bytes are the requested bytes rounded to
pages, counted by the pool and the store, and unlocked and unmapped when the pool gives them back.

Pinning goes through a recording registrar (the same interface ``cudaHostRegister`` sits behind on
CUDA), so the accounting runs on CPU."""

from __future__ import annotations

import sys

import pytest
import torch

from fake_registrar import RecordingRegistrar
from infinity.config import IOConfig, TiersConfig
from infinity.store import HostBufferPool, StoreError, TensorStore, Tier
from infinity.store.pinned_host import PAGE_BYTES, PinnedHostMemory, round_to_pages


def _mapped(ptr: int) -> bool:
    """Whether ``ptr`` lies in a mapping of this process (Linux /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


@pytest.mark.parametrize("nbytes", [1, PAGE_BYTES - 1, PAGE_BYTES, PAGE_BYTES + 1, 3 * 2**20 + 5])
def test_allocate_locks_the_request_rounded_to_pages_and_free_unlocks_it(nbytes):
    reg = RecordingRegistrar()
    mem = PinnedHostMemory(reg)
    buf = mem.allocate(nbytes)
    size = round_to_pages(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == size and buf.data_ptr() % PAGE_BYTES == 0
    assert size - nbytes < PAGE_BYTES and size % PAGE_BYTES == 0
    assert reg.calls == [("register", buf.data_ptr(), size)]
    assert mem.stats()["pinned_bytes"] == size == reg.locked_bytes
    buf.fill_(5)                       # every registered byte is usable memory
    mem.free(buf)
    assert reg.calls[-1] == ("unregister", buf.data_ptr()) and reg.locked_bytes == 0
    assert mem.stats() == {"pinned_bytes": 0, "peak_pinned_bytes": size, "registrations": 1, "unregistrations": 1}
    with pytest.raises(AssertionError, match="freed twice"):
        mem.free(buf)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_freed_buffer_is_unmapped_once_its_last_view_is_gone():
    mem = PinnedHostMemory(RecordingRegistrar())
    buf = mem.allocate(4 * PAGE_BYTES)
    ptr = buf.data_ptr()
    view = buf[PAGE_BYTES:].view(torch.int32)
    mem.free(buf)
    del buf
    assert _mapped(ptr), "a view still held must keep the memory valid (only unlocked)"
    view.fill_(1)
    del view
    assert not _mapped(ptr), "the mapping outlived its last view: the memory did not go back to the OS"


def test_pinned_pool_counts_exactly_what_is_locked_and_gives_it_back_on_trim():
    reg = RecordingRegistrar()
    pool = HostBufferPool(64 * PAGE_BYTES, registrar=reg)
    requests = [100, PAGE_BYTES, 3 * PAGE_BYTES + 1, 5000]
    bufs = [pool.acquire(n) for n in requests]
    want = sum(round_to_pages(n) for n in requests)
    st_ = pool.stats()
    assert st_["pinned"] and st_["pinned_bytes"] == st_["in_use_bytes"] == want == reg.locked_bytes
    assert [c[2] for c in reg.calls] == [round_to_pages(n) for n in requests]
    for b in bufs:
        pool.release(b)
    assert pool.stats()["pinned_bytes"] == want and pool.stats()["cached_bytes"] == want  # cached stay locked
    again = pool.acquire(3 * PAGE_BYTES + 1)           # same rounded size: reused, nothing registered
    assert again.data_ptr() == bufs[2].data_ptr() and len(reg.calls) == len(requests)
    pool.release(again)
    del bufs, again
    assert pool.trim() == want
    assert reg.locked_bytes == 0 and pool.stats()["pinned_bytes"] == 0
    assert sum(c[0] == "unregister" for c in reg.calls) == len(requests)


def test_pinned_pool_unlocks_what_it_drops_to_fit_a_new_size_and_at_window_end():
    reg = RecordingRegistrar()
    pool = HostBufferPool(4 * PAGE_BYTES, registrar=reg)
    for _ in range(2):
        pool.release(pool.acquire(2 * PAGE_BYTES))
    pool.release(pool.acquire(PAGE_BYTES))
    assert reg.locked_bytes == 3 * PAGE_BYTES
    big = pool.acquire(4 * PAGE_BYTES)                 # only fits once both cached buffers are gone
    assert reg.locked_bytes == 4 * PAGE_BYTES == pool.stats()["pinned_bytes"]
    pool.release(big)
    pool.end_window()                                  # the window had 4 pages in use at once: kept
    assert reg.locked_bytes == 4 * PAGE_BYTES
    assert pool.end_window() == 4 * PAGE_BYTES         # a window that used nothing: all unlocked
    assert reg.locked_bytes == 0 == pool.stats()["pinned_bytes"]


def test_a_registration_the_driver_refuses_fails_the_acquire_and_leaves_the_budget_whole():
    reg = RecordingRegistrar(fail_after=1)
    pool = HostBufferPool(8 * PAGE_BYTES, registrar=reg)
    first = pool.acquire(PAGE_BYTES)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pool.acquire(2 * PAGE_BYTES)
    assert pool.stats()["in_use_bytes"] == PAGE_BYTES == pool.stats()["pinned_bytes"]
    pool.release(first)


@pytest.mark.parametrize("code,says", ((712, "part of the range is registered already"),
                                       (2, "could not page-lock it")))
def test_the_cuda_registrar_names_why_the_driver_refused(monkeypatch, code, says):
    """cudaHostRegister's refusals read as their cause: 712 (part of the range registered already: memory
    unmapped without cudaHostUnregister, a leak) is not the full-RAM case the other codes are."""
    import contextlib
    from types import SimpleNamespace

    from infinity.store.pinned_host import CudaHostRegistrar
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=lambda ptr, n, flags: code))
    with pytest.raises(RuntimeError, match=rf"^cudaHostRegister of 4096 bytes at 0x1000 failed with cudaError "
                                           rf"{code}: .*{says}"):
        CudaHostRegistrar(torch.device("cuda", 0)).register(0x1000, 4096)


def test_store_host_tier_pins_its_reserved_bytes_and_releases_them(tmp_path):
    """On CPU with a registrar the store's host copies are page-locked: the locked bytes equal the host
    tier's reserved bytes while held, drop when the step's window ends and are zero after close."""
    reg = RecordingRegistrar()
    s = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=1 << 20), IOConfig(), swap_dir=str(tmp_path),
                    host_registrar=reg)
    try:
        sizes = [3000, 10_000, 4096]
        for i, n in enumerate(sizes):
            s.register(f"k{i}", torch.full((n,), float(i)), home=Tier.NVME).result()
        st_ = s.stats()
        assert st_["tier_bytes"]["host"] == sum(round_to_pages(4 * n) for n in sizes)
        assert reg.locked_bytes == st_["host_pool"]["pinned_bytes"] == st_["tier_bytes"]["host"]
        for i in range(len(sizes)):
            s.evict(f"k{i}", Tier.HOST).result()
        assert s.stats()["tier_bytes"]["host"] == 0 and reg.locked_bytes > 0   # cached for reuse
        s.trim_host_buffers()                          # a window with all 3 held at once: kept
        s.trim_host_buffers()                          # a window holding nothing: given back
        assert reg.locked_bytes == 0
        got = s.wait(s.bring("k1", Tier.HOST))
        assert torch.equal(got, torch.full((10_000,), 1.0))
        assert reg.locked_bytes == round_to_pages(40_000)
    finally:
        s.close()
    assert reg.locked_bytes == 0 and s.stats()["host_pool"]["pinned_bytes"] == 0


def test_store_op_whose_pinning_fails_names_the_cause_and_keeps_the_key(tmp_path):
    reg = RecordingRegistrar(fail_after=1)
    s = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=1 << 20), IOConfig(), swap_dir=str(tmp_path),
                    host_registrar=reg)
    try:
        s.register("a", torch.ones(100), home=Tier.NVME).result()
        s.evict("a", Tier.HOST).result()
        s.trim_host_buffers()
        s.trim_host_buffers()
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            s.bring("a", Tier.HOST).result()
        assert s.stats()["tier_bytes"]["host"] == 0 and "a" in s
        with pytest.raises(StoreError, match="bring"):
            s.get("a", Tier.HOST)
    finally:
        s.close()


def test_closing_a_pinned_pool_unlocks_buffers_still_handed_out():
    """An owner that stops after an error may not have released every buffer: closing its pool unlocks
    them anyway, and a view still held stays usable memory."""
    reg = RecordingRegistrar()
    pool = HostBufferPool(8 * PAGE_BYTES, registrar=reg)
    held = pool.acquire(2 * PAGE_BYTES)
    pool.release(pool.acquire(PAGE_BYTES))
    assert pool.close() == 3 * PAGE_BYTES
    assert reg.locked_bytes == 0 and pool.stats()["pinned_bytes"] == 0 and pool.stats()["in_use_bytes"] == 0
    held.fill_(3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cudaHostRegister")
def test_cuda_registered_buffers_are_page_locked_exactly_and_unlocked_on_free():
    from infinity.store.pinned_host import CudaHostRegistrar

    mem = PinnedHostMemory(CudaHostRegistrar(torch.device("cuda", torch.cuda.current_device())))
    nbytes = 64 * 2**20 + 4096                        # the caching allocator would pin 128 MiB for this
    buf = mem.allocate(nbytes)
    assert buf.is_pinned() and mem.stats()["pinned_bytes"] == round_to_pages(nbytes)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
    dev = buf.to("cuda", non_blocking=True)
    back = torch.empty_like(buf)
    back.copy_(dev)
    assert torch.equal(back, buf)
    torch.cuda.synchronize()
    mem.free(buf)
    assert not buf.is_pinned() and mem.stats()["pinned_bytes"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host buffers")
def test_cuda_store_pins_exactly_its_host_tier(tmp_path):
    s = TensorStore(TiersConfig(device_bytes=1 << 22, host_bytes=1 << 22), IOConfig(), device="cuda",
                    swap_dir=str(tmp_path))
    try:
        for i, n in enumerate([3000, 10_000, 70_000]):
            s.register(f"k{i}", torch.full((n,), float(i)), home=Tier.HOST).result()
        st_ = s.stats()
        assert st_["host_pool"]["pinned"] and st_["host_pool"]["pinned_bytes"] == st_["tier_bytes"]["host"]
        assert s.get("k2", Tier.HOST).is_pinned()
    finally:
        s.close()
    assert s.stats()["host_pool"]["pinned_bytes"] == 0
