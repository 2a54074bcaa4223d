"""The async NVMe I/O engine (infinity/io): round trips, concurrency, checksums, OS errors, files."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import subprocess
import threading
from concurrent.futures import wait

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.config import IOConfig
from infinity.io import (ALIGN_BYTES, ChecksumError, ExtentFile, IOEngine, SwapIOError, Syscalls,
                         aligned_empty, probe_direct_io)
from infinity.io.allocator import ExtentAllocator
from infinity.io.checksum import crc32c, crc32c_combine
from infinity.io.syscalls import O_DIRECT

BLOCK = 64 * 1024  # small pieces so that modest tensors span several pieces and threads


@pytest.fixture
def engine():
    with IOEngine(IOConfig(block_bytes=BLOCK, queue_depth=4, threads=3)) as eng:
        yield eng


def _mount(target, fstype, options):
    """Mount a small file system for the test, or skip saying why not."""
    os.makedirs(target, exist_ok=True)
    args = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(target)]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot run mount ({e}); needs root")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount {fstype} at {target} (needs root): {proc.stderr.strip()}")


@pytest.fixture
def mounts(tmp_path):
    mounted = []

    def mount(name, fstype, options=""):
        target = tmp_path / name
        _mount(target, fstype, options)
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


@pytest.fixture(params=["direct-ext4", "buffered-shm", "auto-ramfs"])
def swap_dir(request, tmp_path, mounts):
    """(directory, direct setting, expected mode) for the file systems the engine must handle."""
    if request.param == "direct-ext4":
        if not probe_direct_io(tmp_path):
            pytest.skip(f"{tmp_path} does not take O_DIRECT on this machine")
        return tmp_path, True, "direct"
    if request.param == "buffered-shm":
        # Linux >= 6.6 tmpfs accepts O_DIRECT, so /dev/shm is forced to buffered here; the
        # auto fallback is tested on ramfs, which has no O_DIRECT on any kernel.
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        return "/dev/shm", False, "buffered"
    # ramfs has no O_DIRECT at all: 'auto' must probe and fall back to buffered I/O.
    return mounts("ramfs", "ramfs"), "auto", "buffered"


def _random_tensor(dtype, numel, gen):
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    return torch.randint(-128, 128, (numel,), dtype=dtype, generator=gen)


# ------------------------------------------------------------------ buffers, checksums, allocator

@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 2**20 + 5])
def test_aligned_empty_is_aligned_and_sized(nbytes):
    for _ in range(3):
        t = aligned_empty(nbytes)
        assert t.dtype == torch.uint8 and t.numel() == nbytes and t.is_contiguous()
        assert t.data_ptr() % ALIGN_BYTES == 0
        t.fill_(7)  # the whole range is usable memory
    with pytest.raises(ValueError, match="nbytes"):
        aligned_empty(-1)


def test_crc32c_is_castagnoli_and_combines_over_concatenation():
    assert crc32c(b"123456789") == 0xE3069283   # CRC-32C's published check value
    rng = random.Random(0)
    for _ in range(200):
        a = rng.randbytes(rng.randint(0, 5000))
        b = rng.randbytes(rng.randint(0, 70000))
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_allocator_first_fit_coalesces_and_rejects_double_free():
    alloc = ExtentAllocator()
    alloc.release(0, 10 * 4096)
    a, b, c = (alloc.allocate(n * 4096) for n in (2, 3, 1))
    assert (a, b, c) == (0, 8192, 20480)
    alloc.release(a, 8192)
    assert alloc.allocate(3 * 4096) == 24576  # the 2-block hole is too small: first fit skips it
    alloc.release(b, 3 * 4096)
    assert alloc.runs() == [(0, 5 * 4096), (9 * 4096, 4096)]  # freed neighbours merged
    assert alloc.allocate(5 * 4096) == 0
    with pytest.raises(AssertionError, match="overlaps"):
        alloc.release(9 * 4096, 4096)
    with pytest.raises(AssertionError, match="multiples"):
        alloc.allocate(100)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 8)), max_size=60))
def test_allocator_never_overlaps_and_conserves_space(ops):
    total = 64 * 4096
    alloc = ExtentAllocator()
    alloc.release(0, total)
    used = {}
    for do_alloc, blocks in ops:
        if do_alloc or not used:
            offset = alloc.allocate(blocks * 4096)
            if offset is None:
                assert max((n for _, n in alloc.runs()), default=0) < blocks * 4096
                continue
            assert offset % 4096 == 0 and offset + blocks * 4096 <= total
            assert all(offset + blocks * 4096 <= o or o + n <= offset for o, n in used.items())
            used[offset] = blocks * 4096
        else:
            offset = sorted(used)[blocks % len(used)]
            alloc.release(offset, used.pop(offset))
        assert alloc.free_bytes() + sum(used.values()) == total
        runs = alloc.runs()
        assert all(a + n < b for (a, n), (b, _) in zip(runs, runs[1:]))  # sorted, never adjacent


# ------------------------------------------------------------------ pieces and depth

class _CountingSyscalls(Syscalls):
    """Counts pwritev calls and the most that were inside the kernel at once."""

    def __init__(self, hold_s):
        super().__init__()
        self.hold_s, self.calls, self.active, self.max_active = hold_s, 0, 0, 0
        self._count_lock = threading.Lock()

    def pwritev(self, fd, buf, offset):
        with self._count_lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            threading.Event().wait(self.hold_s)  # keep the call open so overlap can show
            return super().pwritev(fd, buf, offset)
        finally:
            with self._count_lock:
                self.active -= 1


@pytest.mark.parametrize("threads,queue_depth,expected_depth", [(4, 2, 2), (3, 8, 3), (1, 8, 1)])
def test_requests_split_into_blocks_with_bounded_depth(tmp_path, threads, queue_depth, expected_depth):
    sys_ = _CountingSyscalls(hold_s=0.05)
    with IOEngine(IOConfig(block_bytes=BLOCK, threads=threads, queue_depth=queue_depth), syscalls=sys_) as eng, \
            ExtentFile(tmp_path, eng, direct=False) as f:
        t = torch.randn(12 * BLOCK // 4 + 3)  # 12 full pieces and a 12-byte tail
        f.write("k", t).result()
        assert sys_.calls == 13
        # the pieces' CRCs, taken on different threads, combine into the whole tensor's
        assert f._table["k"].crc32c == crc32c(t.numpy().tobytes())
        assert sys_.max_active == expected_depth
        out = torch.empty_like(t)
        f.read("k", out).result()
        assert torch.equal(out, t)


# ------------------------------------------------------------------ round trips

SIZES_BYTES = [0, 1, 2, 3, 4095, 4096, 4097, BLOCK, BLOCK + 1, 3 * BLOCK + 123, 2**20 + 4096]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_round_trip_every_dtype_and_size(swap_dir, engine, dtype):
    directory, direct, mode = swap_dir
    gen = torch.Generator().manual_seed(1)
    with ExtentFile(directory, engine, direct=direct) as f:
        assert f.mode == mode and f.stats()["mode"] == mode
        stored = {}
        for nbytes in SIZES_BYTES:
            numel = nbytes // dtype.itemsize
            t = _random_tensor(dtype, numel, gen)
            stored[f"aligned-{nbytes}"] = t
            # A view one element in: its address is not 4096-aligned (bounce-buffer path).
            base = _random_tensor(dtype, numel + 1, gen)
            stored[f"offset-{nbytes}"] = base[1:]
        futures = [f.write(k, t) for k, t in stored.items()]
        for fut in futures:
            assert fut.result() is None
        for key, t in stored.items():
            assert f.contains(key) and f.nbytes(key) == t.numel() * t.element_size()
            whole = torch.full((t.numel() + 2,), 3, dtype=dtype)
            dst = whole[1:-1]  # unaligned destination with guard elements either side
            f.read(key, dst).result()
            assert torch.equal(dst, t), key
            assert whole[0] == 3 and whole[-1] == 3, f"{key}: read wrote outside the destination"


def test_direct_mode_really_opens_with_o_direct(tmp_path, engine):
    if not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT here")
    with ExtentFile(tmp_path, engine, direct="auto") as f:
        assert f.mode == "direct"
        assert fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & O_DIRECT
    with ExtentFile(tmp_path, engine, direct=False) as f:
        assert f.mode == "buffered"
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & O_DIRECT


def test_shm_auto_mode_follows_the_probe(engine):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    expected = "direct" if probe_direct_io("/dev/shm") else "buffered"
    with ExtentFile("/dev/shm", engine) as f:
        assert f.mode == expected
        t = torch.arange(5000, dtype=torch.float32)
        f.write("x", t).result()
        out = torch.empty_like(t)
        f.read("x", out).result()
        assert torch.equal(out, t)


def test_direct_true_on_a_file_system_without_o_direct_is_a_clear_error(mounts, engine):
    ramfs = mounts("ramfs", "ramfs")
    with pytest.raises(SwapIOError, match="rejects O_DIRECT") as info:
        ExtentFile(ramfs, engine, direct=True)
    assert info.value.errno == errno.EINVAL and str(ramfs) in str(info.value)
    assert os.listdir(ramfs) == []  # the private directory made before the check is gone again


def test_rewrite_free_and_space_reuse(tmp_path, engine):
    with ExtentFile(tmp_path, engine) as f:
        a = torch.randn(100_000)
        f.write("k", a).result()
        size_after_first = f.stats()["file_bytes"]
        b = torch.randn(7)  # rewrite with another size
        f.write("k", b).result()
        out = torch.empty(7)
        f.read("k", out).result()
        assert torch.equal(out, b) and f.nbytes("k") == 28
        for i in range(50):  # write/free cycles reuse freed space instead of growing the file
            f.write(f"t{i}", a).result()
            f.free(f"t{i}")
        assert f.stats()["file_bytes"] == size_after_first
        f.free("k")
        assert not f.contains("k") and f.keys() == []
        with pytest.raises(KeyError, match="'k'"):
            f.free("k")


def test_many_concurrent_ops_in_random_order(swap_dir, engine):
    directory, direct, _ = swap_dir
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
    with ExtentFile(directory, engine, direct=direct) as f:
        expect = {}
        for i in range(48):
            t = _random_tensor(rng.choice(dtypes), rng.randint(0, 3 * BLOCK // 2), gen)
            expect[f"k{i}"] = t[rng.randint(0, 1):]  # half of them unaligned
        futures = {k: f.write(k, t) for k, t in expect.items()}
        wait(list(futures.values()))
        assert all(fut.exception() is None for fut in futures.values())
        # Reads of half the keys race rewrites of the other half, submitted in shuffled order.
        keys = list(expect)
        rng.shuffle(keys)
        readers, rewrites, outs = [], {}, {}
        for i, key in enumerate(keys):
            if i % 2:
                outs[key] = torch.empty_like(expect[key])
                readers.append(f.read(key, outs[key]))
            else:
                rewrites[key] = _random_tensor(torch.float32, rng.randint(1, BLOCK), gen)
                f.write(key, rewrites[key])
        for fut in readers:
            fut.result()
        for key, out in outs.items():
            assert torch.equal(out, expect[key]), key
        f.flush()  # waits for the rewrites too
        for key, t in rewrites.items():
            out = torch.empty_like(t)
            f.read(key, out).result()
            assert torch.equal(out, t), key


def test_short_reads_and_writes_are_completed(tmp_path):
    class ShortSyscalls(Syscalls):
        """Moves at most 1000 bytes per call, like a signal-interrupted transfer."""

        def preadv(self, fd, buf, offset):
            return super().preadv(fd, buf[:1000], offset)

        def pwritev(self, fd, buf, offset):
            return super().pwritev(fd, buf[:1000], offset)

    with IOEngine(IOConfig(block_bytes=BLOCK, threads=2), syscalls=ShortSyscalls()) as eng:
        with ExtentFile(tmp_path, eng, direct=False) as f:
            t = torch.randn(50_001)
            f.write("k", t).result()
            out = torch.empty_like(t)
            f.read("k", out).result()
            assert torch.equal(out, t)


# ------------------------------------------------------------------ checksums

@pytest.mark.parametrize("direct", [True, False])
def test_corrupt_byte_is_a_checksum_error_naming_key_and_file(tmp_path, engine, direct):
    if direct and not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT here")
    with ExtentFile(tmp_path, engine, direct=direct) as f:
        t = torch.randn(30_000)
        f.write("layer.3.exp_avg", t).result()
        f.flush()
        fd = os.open(f.path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, 12345)
            os.pwrite(fd, bytes([byte[0] ^ 0x10]), 12345)  # the only extent starts at offset 0
            os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(ChecksumError) as info:
            f.read("layer.3.exp_avg", torch.empty_like(t)).result()
        err = info.value
        assert isinstance(err, SwapIOError) and err.errno == errno.EIO
        assert err.key == "layer.3.exp_avg" and err.path == f.path
        assert "layer.3.exp_avg" in str(err) and f.path in str(err) and "checksum" in str(err)
        assert f.stats()["failed"] == 1


def test_without_checksum_corruption_goes_unnoticed(tmp_path, engine):
    """The check above is what catches corruption: with checksum off, the same flip reads back silently."""
    with ExtentFile(tmp_path, engine, direct=False, checksum=False) as f:
        t = torch.zeros(1024, dtype=torch.uint8)
        f.write("k", t).result()
        f.flush()
        fd = os.open(f.path, os.O_RDWR)
        os.pwrite(fd, b"\x01", 3)
        os.close(fd)
        out = torch.empty_like(t)
        f.read("k", out).result()
        assert out[3] == 1 and f.stats()["checksum"] is False


# ------------------------------------------------------------------ OS errors

def test_real_full_file_system_is_enospc(mounts, engine):
    tiny = mounts("tiny", "tmpfs", "size=1m")
    with ExtentFile(tiny, engine) as f:
        chunk = torch.randn(256 * 1024 // 4)  # 256 KiB
        stored = []
        error = None
        for i in range(10):  # 2.5 MiB into a 1 MiB file system
            fut = f.write(f"k{i}", chunk)
            if fut.exception() is not None:
                error = fut.exception()
                break
            stored.append(f"k{i}")
        assert isinstance(error, SwapIOError), error
        assert error.errno == errno.ENOSPC and error.path == f.path and error.nbytes > 0
        assert f.path in str(error) and "full" in str(error) and str(error.nbytes) in str(error)
        assert not f.contains(f"k{len(stored)}") and len(stored) >= 1
        for key in stored:  # what was stored before the disk filled is still intact
            out = torch.empty_like(chunk)
            f.read(key, out).result()
            assert torch.equal(out, chunk)
        f.free(stored[0])  # and freed space is usable again
        f.write("again", chunk).result()


def test_read_only_file_system_is_a_clear_error(mounts, engine):
    ro = mounts("ro", "tmpfs", "ro,size=1m")
    with pytest.raises(SwapIOError) as info:
        ExtentFile(ro, engine)
    assert info.value.errno == errno.EROFS and str(ro) in str(info.value) and "read-only" in str(info.value)


def test_missing_directory_is_a_clear_error(tmp_path, engine):
    missing = tmp_path / "no" / "such"
    with pytest.raises(SwapIOError, match="does not exist") as info:
        ExtentFile(missing, engine)
    assert info.value.errno == errno.ENOENT and str(missing) in str(info.value)
    with pytest.raises(SwapIOError) as info:
        ExtentFile(missing / "rank0.swap", engine)
    assert info.value.errno == errno.ENOENT


def test_permission_denied_is_a_clear_error(tmp_path):
    # As root, chmod does not stop writes, so EACCES is injected where the OS would raise it.
    with IOEngine(IOConfig(block_bytes=BLOCK)) as eng:
        eng.syscalls.inject("mkdir", errno.EACCES)
        with pytest.raises(SwapIOError) as info:
            ExtentFile(tmp_path, eng)
        assert info.value.errno == errno.EACCES and info.value.op == "mkdir"
        assert str(tmp_path) in str(info.value) and "permission" in str(info.value)
        eng.syscalls.inject("open", errno.EACCES)
        with pytest.raises(SwapIOError) as info:
            ExtentFile(tmp_path / "rank0.swap", eng)
        assert info.value.op == "open" and "rank0.swap" in str(info.value)
        assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("direct", [True, False])
def test_injected_eio_on_write_leaves_key_unstored(tmp_path, direct):
    if direct and not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT here")
    with IOEngine(IOConfig(block_bytes=BLOCK, threads=2)) as eng, ExtentFile(tmp_path, eng, direct=direct) as f:
        old = torch.randn(40_000)
        f.write("k", old).result()
        eng.syscalls.inject("pwritev", errno.EIO)
        new = torch.randn(40_000)  # 160 KB = 3 pieces; one of them fails
        with pytest.raises(SwapIOError) as info:
            f.write("k", new).result()
        err = info.value
        assert err.errno == errno.EIO and err.path == f.path and err.nbytes == 160_000
        assert "160000 bytes" in str(err) and f.path in str(err) and "pwrite" in str(err)
        # The prior good version is not trusted once its rewrite started (documented in ExtentFile).
        assert not f.contains("k") and f.keys() == []
        with pytest.raises(KeyError):
            f.read("k", torch.empty_like(old))
        assert f.stats()["free_bytes"] == f.stats()["file_bytes"]  # the failed extent was freed
        f.write("k", new).result()  # the engine recovers: the next write works
        out = torch.empty_like(new)
        f.read("k", out).result()
        assert torch.equal(out, new)
        assert eng.stats()["failed_requests"] == 1


def test_injected_eio_on_read_and_fsync(tmp_path, engine):
    with ExtentFile(tmp_path, engine) as f:
        t = torch.randn(40_000)
        f.write("k", t).result()
        engine.syscalls.inject("preadv", errno.EIO, count=2)
        with pytest.raises(SwapIOError) as info:
            f.read("k", torch.empty_like(t)).result()
        assert info.value.errno == errno.EIO and "pread" in str(info.value) and "I/O error" in str(info.value)
        engine.syscalls.clear()
        out = torch.empty_like(t)
        f.read("k", out).result()  # the key itself is still stored and good
        assert torch.equal(out, t)
        engine.syscalls.inject("fdatasync", errno.EIO)
        with pytest.raises(SwapIOError, match="fdatasync"):
            f.flush()


def test_injected_enospc_on_growth(tmp_path, engine):
    with ExtentFile(tmp_path, engine) as f:
        engine.syscalls.inject("fallocate", errno.ENOSPC, count=2)  # the big step, then the exact size
        fut = f.write("k", torch.randn(10))
        assert isinstance(fut.exception(), SwapIOError) and fut.exception().op == "fallocate"
        assert fut.exception().errno == errno.ENOSPC and not f.contains("k")
        engine.syscalls.inject("fallocate", errno.ENOSPC, count=1)  # only the big step fails: fits exactly
        f.write("k", torch.randn(10)).result()
        assert f.stats()["file_bytes"] == 4096


# ------------------------------------------------------------------ files, misuse, stats, lifecycle

def test_modes_and_cleanup(tmp_path, engine):
    f = ExtentFile(tmp_path, engine)
    private = os.path.dirname(f.path)
    assert os.stat(private).st_mode & 0o777 == 0o700
    assert os.stat(f.path).st_mode & 0o777 == 0o600
    f.write("k", torch.randn(10)).result()
    f.close()
    f.close()  # idempotent
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        f.write("k", torch.randn(10))
    keep = tmp_path / "rank3.swap"
    with ExtentFile(keep, engine, direct=False) as g:
        assert g.path == str(keep) and os.stat(keep).st_mode & 0o777 == 0o600
    assert not keep.exists()
    g = ExtentFile(keep, engine)
    g.close(remove=False)
    assert keep.exists()


def test_misuse_is_rejected_with_names(tmp_path):
    gate = threading.Event()

    class GatedSyscalls(Syscalls):
        def pwritev(self, fd, buf, offset):
            gate.wait(30)
            return super().pwritev(fd, buf, offset)

    with IOEngine(IOConfig(block_bytes=BLOCK), syscalls=GatedSyscalls()) as eng, ExtentFile(tmp_path, eng) as f:
        gate.set()
        f.write("w", torch.randn(500)).result()
        with pytest.raises(ValueError, match=r"'w'.*2000 bytes.*40 bytes"):
            f.read("w", torch.empty(10))
        with pytest.raises(ValueError, match="contiguous"):
            f.write("nc", torch.randn(10, 10).t())
        with pytest.raises(KeyError, match="'absent'"):
            f.read("absent", torch.empty(1))
        gate.clear()
        fut = f.write("busy", torch.randn(100))
        assert not f.contains("busy")  # not readable before its write completed
        with pytest.raises(RuntimeError, match="being written"):
            f.read("busy", torch.empty(100))
        with pytest.raises(RuntimeError, match="being written"):
            f.write("busy", torch.randn(100))
        gate.set()
        fut.result()
        assert f.contains("busy")


def test_stats_count_bytes_requests_and_time(tmp_path):
    with IOEngine(IOConfig(block_bytes=BLOCK, threads=2)) as eng, ExtentFile(tmp_path, eng) as f:
        t = torch.randn(100_000)
        f.write("a", t).result()
        f.read("a", torch.empty_like(t)).result()
        f.read("a", torch.empty_like(t)).result()
        s = f.stats()
        assert (s["bytes_written"], s["bytes_read"], s["writes"], s["reads"]) == (400_000, 800_000, 1, 2)
        assert s["checksum"] is True and s["mode"] in ("direct", "buffered") and s["keys"] == 1
        assert s["stored_bytes"] == 400_000 and s["file_bytes"] >= 401_408
        e = eng.stats()
        assert (e["bytes_written"], e["bytes_read"], e["write_requests"], e["read_requests"]) == (400_000, 800_000, 1, 2)
        assert e["busy_s"] > 0 and e["checksum_s"] > 0 and e["threads"] == 2 and e["block_bytes"] == BLOCK


def test_engine_close_finishes_pending_work_then_refuses(tmp_path):
    eng = IOEngine(IOConfig(block_bytes=BLOCK, threads=2))
    f = ExtentFile(tmp_path, eng, direct=False)
    t = torch.randn(200_000)
    fut = f.write("k", t)
    eng.close()
    assert fut.done() and fut.exception() is None and f.contains("k")
    with pytest.raises(RuntimeError, match="closed"):
        f.read("k", torch.empty_like(t)).result()
    f.close()
    with pytest.raises(ValueError, match="block_bytes"):
        IOEngine(IOConfig(block_bytes=1000))


def test_a_truncated_swap_file_is_not_blamed_on_the_device(tmp_path):
    """A swap file cut short by someone else reads as truncated (resume from a checkpoint), not as a disk
    error to look up in dmesg."""
    with IOEngine() as engine:
        f = ExtentFile(str(tmp_path), engine, direct=False)
        try:
            f.write("k", torch.arange(4096, dtype=torch.float32)).result()
            f.flush()
            os.truncate(f.path, 0)
            with pytest.raises(SwapIOError) as info:
                f.read("k", torch.empty(4096, dtype=torch.float32)).result()
        finally:
            f.close()
    msg = str(info.value)
    assert "unexpected end of file" in msg and "shorter than what this run wrote" in msg
    assert "dmesg" not in msg and "\n" not in msg


class _OrderSyscalls(Syscalls):
    """Records the kind of every piece moved; the first call says it has begun (``entered``) and waits for
    ``gate``, so that everything a test submits next is queued before the (single) worker takes more."""

    def __init__(self, gate: threading.Event):
        super().__init__()
        self.gate, self.entered, self.kinds = gate, threading.Event(), []

    def _held(self, kind):
        if not self.kinds:
            self.entered.set()
            self.gate.wait(30)
        self.kinds.append(kind)

    def preadv(self, fd, buf, offset):
        self._held("r")
        return super().preadv(fd, buf, offset)

    def pwritev(self, fd, buf, offset):
        self._held("w")
        return super().pwritev(fd, buf, offset)


def _runs(kinds: list) -> list:
    """["r", "r", "w"] -> [("r", 2), ("w", 1)]"""
    out = []
    for k in kinds:
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1] + 1)
        else:
            out.append((k, 1))
    return out


@pytest.mark.parametrize("phase_pieces", [0, 3, 100])
def test_phased_io_serves_one_kind_at_a_time(tmp_path, phase_pieces):
    """Reads and writes submitted alternately (4 pieces each; the worker holds the first read's first
    piece until all are queued): with phase_bytes 0 the disk sees them in submission order; with
    phase_bytes = 3 pieces each phase takes 3 pieces of one kind (a request's tail, then the next
    request's head) before the other kind, waiting, gets its turn; with phases longer than the queue,
    all of the first kind, then all of the other. Every byte still lands right."""
    gate = threading.Event()
    sys_ = _OrderSyscalls(gate)
    piece = BLOCK // 4   # fp32 elements per piece
    with IOEngine(IOConfig(block_bytes=BLOCK, threads=1, phase_bytes=phase_pieces * BLOCK), syscalls=sys_) as eng, \
            ExtentFile(tmp_path, eng, direct=False) as f:
        stored = {f"s{i}": torch.randn(4 * piece) for i in range(4)}
        for k, t in stored.items():
            gate.set()
            f.write(k, t).result()
        sys_.kinds.clear()
        sys_.entered.clear()
        gate.clear()
        fresh = {f"n{i}": torch.randn(4 * piece) for i in range(4)}
        outs = {k: torch.empty(4 * piece) for k in stored}
        futures = []
        for (rk, out), (wk, t) in zip(outs.items(), fresh.items()):   # r w r w r w r w, 4 pieces each
            futures.append(f.read(rk, out))
            if len(futures) == 1:
                assert sys_.entered.wait(30)   # the worker holds the first read's first piece
            futures.append(f.write(wk, t))
        gate.set()
        for fut in futures:
            fut.result()
        for k in stored:
            assert torch.equal(outs[k], stored[k]), k
        for k, t in fresh.items():
            back = torch.empty_like(t)
            f.read(k, back).result()
            assert torch.equal(back, t), k
        runs = _runs(sys_.kinds[:32])
        switches = eng.stats()["phase_switches"]
    if phase_pieces == 0:
        assert runs == [("r", 4), ("w", 4)] * 4 and switches == 0
    elif phase_pieces == 3:
        # 16 pieces of each kind in phases of 3: five full phases each, then the last read and the last
        # write (no switch is counted when the phase's own kind has run out)
        assert runs == [("r", 3), ("w", 3)] * 5 + [("r", 1), ("w", 1)], runs
        assert switches == 10
    else:
        assert runs == [("r", 16), ("w", 16)] and switches == 0
