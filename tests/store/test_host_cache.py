"""``tiers.host_cache_bytes``: freed large host blocks are kept for reuse, up to a cap, by torch's CPU allocator.

Each case runs in a child process: the cache replaces torch's CPU allocator process-wide, and what it
keeps shows in RSS, so neither should leak between cases or into the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mmap and /proc")

MIB = 2**20


def _run(tmp_path, body: str, *args, env=None) -> dict:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        import torch
        torch.set_num_threads(1)
        from infinity.store import host_cache

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
    """) + textwrap.dedent(body))
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, str(script), *map(str, args)], env=dict(base, **(env or {})),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_within_the_cap_and_values_stay_right(tmp_path):
    r = _run(tmp_path, """
        assert host_cache.configure(4 * 2**20, 64 * 2**20) is None, "no cache"
        s0 = host_cache.stats()
        a = torch.empty(8 * 2**20, dtype=torch.uint8); first = a.data_ptr(); a.fill_(7); del a
        s1 = host_cache.stats()
        before = rss()
        b = torch.empty(8 * 2**20 - 4096, dtype=torch.uint8)   # the same size class
        reused = b.data_ptr() == first
        b.fill_(3); ok = int(b.min()) == 3 == int(b.max()); grew = rss() - before; del b
        small = torch.empty(2**20, dtype=torch.uint8); del small   # below the threshold: not the cache's
        s2 = host_cache.stats()
        # three 32 MiB blocks freed: two fit the 64 MiB cap, the third is unmapped
        blocks = [torch.ones(8 * 2**20) for _ in range(3)]
        del blocks
        s3 = host_cache.stats()
        x = torch.randn(1024, 1536); w = torch.randn(1536, 1536)   # matmul outputs of 6 MiB, cached
        y1 = (x @ w).sum().item(); y2 = (x @ w).sum().item()
        pre = host_cache.stats()["cached_bytes"]
        trimmed = host_cache.trim(0)
        s4 = host_cache.stats()
        host_cache.configure(4 * 2**20, 0)   # off: requests go straight through, nothing is kept
        c = torch.empty(16 * 2**20, dtype=torch.uint8); del c
        s5 = host_cache.stats()
        print(json.dumps(dict(s0=s0, s1=s1, s2=s2, s3=s3, s4=s4, s5=s5, reused=reused, ok=ok, grew=grew,
                              trimmed=trimmed, pre=pre, same=y1 == y2)))
    """)
    s0, s1, s2, s3, s4, s5 = (r[k] for k in ("s0", "s1", "s2", "s3", "s4", "s5"))
    assert s0["misses"] == 0 and s0["cached_bytes"] == 0
    assert s1["misses"] == 1 and s1["cached_bytes"] == 8 * MIB and s1["in_use_bytes"] == 0
    assert r["reused"] and r["ok"] and s2["hits"] == 1 and s2["misses"] == 1, r
    assert r["grew"] < 4 * MIB, f"a reused block's pages were faulted in again: {r['grew']} bytes"
    assert s3["cached_bytes"] <= 64 * MIB and s3["dropped"] >= 1 and s3["peak_cached_bytes"] >= 64 * MIB, s3
    assert r["same"] and s4["hits"] > s3["hits"]
    assert r["trimmed"] == r["pre"] > 0
    assert s4["cached_bytes"] == 0
    assert (s5["hits"], s5["misses"], s5["cached_bytes"]) == (s4["hits"], s4["misses"], 0), "off still served"


def test_initialize_turns_the_cache_on_when_offloading_and_close_gives_its_blocks_back(tmp_path):
    r = _run(tmp_path, """
        import infinity
        from infinity.zero.memory_report import StepMemory
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
        conf = {"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "params": "nvme"},
                "tiers": {"nvme_path": sys.argv[1], "host_cache_bytes": sys.argv[2]}}
        model, opt = infinity.initialize(model, conf)
        engine = infinity.engine_of(model)
        engine.memory.enable()
        for _ in range(3):
            model(torch.randn(1024, 1024)).square().mean().backward()   # 8 MiB activations
            opt.step(); opt.zero_grad()
        s = host_cache.stats()
        report = engine.memory.last
        engine.close()
        print(json.dumps(dict(stats=s, after_close=host_cache.stats()["cached_bytes"],
                              reported=report["host_cache_bytes"])))
    """, tmp_path / "swap", "auto")
    assert r["stats"]["hits"] > 0 and r["stats"]["misses"] > 0, r
    assert 0 < r["reported"] <= 512 * MIB, r
    assert r["after_close"] == 0
    off = _run(tmp_path, """
        import infinity
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
        conf = {"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "params": "nvme"},
                "tiers": {"nvme_path": sys.argv[1], "host_cache_bytes": sys.argv[2]}}
        model, opt = infinity.initialize(model, conf)
        model(torch.randn(1024, 1024)).square().mean().backward()
        opt.step()
        print(json.dumps(host_cache.stats()))
    """, tmp_path / "swap2", "0")
    assert off["hits"] == 0 and off["misses"] == 0, off


def test_without_a_compiler_initialize_says_why_and_trains_without_the_cache(tmp_path):
    r = _run(tmp_path, """
        import logging, io
        import infinity
        buf = io.StringIO(); logging.getLogger("infinity").addHandler(logging.StreamHandler(buf))
        model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        conf = {"offload": {"optimizer": "nvme"}, "tiers": {"nvme_path": sys.argv[1]}}
        model, opt = infinity.initialize(model, conf)
        model(torch.randn(4, 64)).sum().backward(); opt.step()
        print(json.dumps(dict(log=buf.getvalue(), stats=host_cache.stats())))
    """, tmp_path / "swap", env={"CXX": str(tmp_path / "no-such-c++"), "INFINITY_CACHE": str(tmp_path / "lib")})
    assert f"no C++ compiler {str(tmp_path / 'no-such-c++')!r} (set CXX)" in r["log"], r["log"]
    assert "tiers.host_cache_bytes" in r["log"] and r["stats"]["misses"] == 0


def test_the_setting_is_checked_and_follows_the_threshold():
    from infinity.config import Config, ConfigError
    from infinity.store.host_cache import AUTO_CACHE_BYTES, cache_bytes

    for bad in ("lots", -1, 1.5):
        with pytest.raises(ConfigError, match="tiers.host_cache_bytes"):
            Config.load({"tiers": {"host_cache_bytes": bad}})
    assert Config.load({"tiers": {"host_cache_bytes": "256MiB"}}).tiers.host_cache_bytes == 256 * MIB
    assert cache_bytes("auto", 4 * MIB) == AUTO_CACHE_BYTES and cache_bytes("auto", None) == 0
    assert cache_bytes(0, 4 * MIB) == 0 and cache_bytes(256 * MIB, None) == 256 * MIB

