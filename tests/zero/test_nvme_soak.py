"""200 steps with everything on NVMe: RSS stays flat and the swap files do not grow.

A child process (``rss_script.py soak``: its RSS is its own) trains a small GPT (4 x 128, vocab 512,
~0.9M params, 2 x 64 tokens a step) at stage 3 with parameters, gradients and optimizer states on NVMe
(host tier 4 MiB, device tier 1 MiB, ``max_live_bytes`` 3 MiB: the store evicts and rereads every
step), reading RSS and the size of every file under the swap directory after each step.

RSS after step 20 and after step 200 must differ by < 1%. Both are read after ``malloc_trim(0)``: glibc
keeps freed small blocks in its heap, and how much of that is free at a given moment moves the raw
figure by up to ~3 MiB (0.2-0.9% here, +1.3 MiB of heap from step 20 to 200) with nothing in use
growing; trimmed, the figure is memory in use, so a leak of 32 KB a step fails it (+1.9%). Swap extents
that were not reused would grow the file.

Measured here: 315.3 -> 316.2 MiB trimmed (+0.3%; raw 323.0 -> 324.3, +0.4%), a 64 MiB swap file from
the first step to the last; ~16 s.
"""

from __future__ import annotations

from rss_child import run_child

STEPS = 200


def test_rss_and_swap_files_flat_over_200_nvme_steps(tmp_path):
    swap = tmp_path / "swap"
    r = run_child("soak", str(swap), str(STEPS))
    rss, disk, trimmed = r["rss"], r["disk"], r["trimmed_rss"]
    assert len(rss) == len(disk) == STEPS
    at20, at200 = trimmed.get("20", rss[19]), trimmed.get("200", rss[199])
    assert abs(at200 - at20) < 0.01 * at20, (
        f"RSS after step 20 {at20 / 2**20:.1f} MiB, after step 200 {at200 / 2**20:.1f} MiB "
        f"({(at200 - at20) / at20:+.2%}); raw, every 20 steps: {[round(x / 2**20, 1) for x in rss[19::20]]}")
    assert disk[19]["size"] > 0, "nothing was swapped to NVMe"
    for key in ("size", "allocated"):
        assert disk[199][key] <= disk[19][key], (key, disk[19], disk[199])
    assert min(r["nvme_reads"][19:]) > 0, "a step read nothing from NVMe: the soak did not exercise the disk"
