"""fp16 loss scaling (skip + count overflowed steps, dynamic scale) and the reduce dtype."""

from __future__ import annotations

import pytest

from world import World
import zero_cases
from zero_cases import compare, reference_run


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    with World(2, tmp_path_factory.mktemp("world2")) as w:
        yield w


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_fp16_overflow_skips_and_counts(world2, stage):
    """A 2^22 scale overflows fp16 gradients: those steps are skipped (params unchanged) and counted,
    the scale halves on each overflow and doubles after ``window`` (2) good steps in a row."""
    spec = dict(stage=stage, lr=1e-3, steps=10, batch=4, scale=2.0 ** 22, window=2)
    for r in world2.run(zero_cases.fp16_case, spec):
        assert r["skipped"][:2] == [1, 1], r["skipped"]   # 2^21 still overflows
        assert sum(1 for x in r["skipped"] if x == 0) >= 3, r["skipped"]
        assert r["moved"] == [not x for x in r["skipped"]]
        assert r["scaler_skipped"] == sum(r["skipped"])
        scale, good, expected = 2.0 ** 22, 0, []
        for skipped in r["skipped"]:
            if skipped:
                scale, good = scale / 2, 0
            else:
                good += 1
                scale = scale * 2 if good % 2 == 0 else scale
            expected.append(scale)
        assert r["scales"] == expected


def test_fp16_trains_like_fp32(world2):
    """fp16 compute with a sane scale, fp32 master: close to the fp32 reference (loose, like bf16)."""
    spec = dict(model="gpt", steps=3, batch=8, lr=1e-2, stage=3, dtype="fp16")
    got = world2.run(zero_cases.train_case, spec)[0]
    compare(got, reference_run(spec), loss_rtol=5e-3, max_update_error=0.25)


@pytest.mark.parametrize("stage", (0, 2))
def test_bf16_reduce_dtype(world2, stage):
    """Gradients reduced in bf16 (half the bytes) still train close to the fp32 reference."""
    spec = dict(model="gpt", steps=3, batch=8, lr=1e-2, stage=stage, dtype="bf16", reduce="bf16")
    got = world2.run(zero_cases.train_case, spec)[0]
    compare(got, reference_run(spec), loss_rtol=5e-3, max_update_error=0.25)
    coll = got["stats"][-1]["collectives"]
    moved = {k: v for k, v in coll["bytes"].items() if v}
    assert all(coll["bytes"][k] == 2 * coll["elements"][k] for k in moved), coll
