"""``tiers.malloc_mmap_threshold``: with anything offloaded, freed multi-MiB blocks go back to the OS.

glibc raises its mmap threshold to the size of each large block freed, so the
next block of that size comes from the heap and stays in RSS after it is
freed. A child process initializes an offloaded engine (threshold auto, or
``off`` as the control, or auto under a ``MALLOC_MMAP_THRESHOLD_`` the user
set), frees one 24 MiB tensor, allocates and frees another, and reports how much
of it RSS kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    import infinity

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    conf = {"zero": {"stage": 1}, "offload": {"optimizer": "nvme"},
            "tiers": {"nvme_path": sys.argv[1], "malloc_mmap_threshold": sys.argv[2],
                      "host_cache_bytes": 0}}   # the threshold alone (the cache: test_host_cache.py)
    model, opt = infinity.initialize(model, conf)
    n = 24 * 2**20 // 4
    before = rss()
    a = torch.ones(n)      # default: mapped (above any threshold so far)...
    del a                  # ... and unmapped, and glibc's default now raises its threshold past 24 MiB
    b = torch.ones(n)      # default: from the heap; fixed 4 MiB threshold: mapped again
    during = rss()
    del b
    after = rss()
    infinity.engine_of(model).close()
    print(json.dumps({"held_during": during - before, "kept_after_free": after - before}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc")
def test_freed_blocks_return_to_the_os_when_offloading(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def run(setting, **extra_env):
        out = subprocess.run([sys.executable, str(script), str(tmp_path / f"{setting}{len(extra_env)}"), setting],
                             env=dict(env, **extra_env), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    mib = 2**20
    control, fixed = run("off"), run("auto")
    assert control["held_during"] > 20 * mib and fixed["held_during"] > 20 * mib, (control, fixed)
    assert control["kept_after_free"] > 20 * mib, f"the control did not keep the block: {control}"
    assert fixed["kept_after_free"] < 2 * mib, f"with the fixed threshold the block stayed in RSS: {fixed}"
    # a threshold the environment fixes is the user's choice: auto leaves it (32 MiB, with heap trimming
    # off, keeps this block; auto's 4 MiB would map and unmap it)
    chosen = run("auto", MALLOC_MMAP_THRESHOLD_=str(32 * mib), MALLOC_TRIM_THRESHOLD_=str(256 * mib))
    assert chosen["kept_after_free"] > 20 * mib, f"auto overrode MALLOC_MMAP_THRESHOLD_: {chosen}"


def test_a_threshold_glibc_cannot_take_is_refused_naming_the_key():
    from infinity.config import Config, ConfigError

    for bad in ("64MiB", "0", "lots"):
        with pytest.raises(ConfigError, match="tiers.malloc_mmap_threshold"):
            Config.load({"tiers": {"malloc_mmap_threshold": bad}})
    assert Config.load({"tiers": {"malloc_mmap_threshold": "1MiB"}}).tiers.malloc_mmap_threshold == 2**20


TRIM_CHILD = textwrap.dedent("""
    import json
    import torch
    from infinity.store.host_malloc import release_free_heap

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    blocks = [torch.ones(8192) for _ in range(12000)]    # 32 KiB each, 375 MiB: heap blocks, below any threshold
    keep = blocks[::16]                                  # every 16th stays: the heap cannot shrink from its top
    del blocks
    kept = rss() - before
    released = release_free_heap()
    print(json.dumps({"kept": kept, "after_release": rss() - before, "released": released, "alive": len(keep)}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc")
def test_release_free_heap_gives_fragmented_free_pages_back(tmp_path):
    """What ``auto``'s planning frees below the mmap threshold stays in the heaps (and in the engine's baseline
    RSS) until :func:`release_free_heap`: a heap held up by every 16th block keeps almost all of its free pages;
    after the release only the live blocks' pages (1/16 of them) and the torn ends remain."""
    script = tmp_path / "trim.py"
    script.write_text(TRIM_CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert r["kept"] > 300 * mib, f"the freed blocks left the heap before the release: {r}"
    assert r["released"] is True, r
    assert r["after_release"] < 60 * mib, f"release_free_heap left the free pages in RSS: {r}"


def test_planning_releases_what_it_freed(monkeypatch):
    """``plan_request`` gives back the quick profile's and the compute timing's freed heap after planning."""
    import infinity.plan.auto as auto

    order = []
    monkeypatch.setattr(auto, "rates_for", lambda *a, **k: order.append("rates") or "rates")
    monkeypatch.setattr(auto, "run_plan", lambda request, rates: order.append("plan") or "plan")
    monkeypatch.setattr(auto, "release_free_heap", lambda: order.append("release") or True)
    assert auto.plan_request(None, None, None, 1) == "plan"
    assert order == ["rates", "plan", "release"]
