"""``zero.activation_offload``: each unit's saved activations wait in host memory or NVMe files between its
forward and its backward.

Training with them offloaded is bitwise the training that keeps them (losses and every parameter,
``torch.equal``), with activation checkpointing (only the units' inputs move) and without (every saved
tensor worth moving: permuted views, softmax outputs, bool masks), at stages 0-3, with accumulation and the
overlapped update, at world sizes 1 and 2. Every key is released once its backward ran. A full disk while
saving, or a corrupt file read back in backward, is one line naming the cause; the micro-step runs again
and the run ends where the reference does. The offload's own pieces are tested without an engine.
"""

from __future__ import annotations

import pytest
import torch

import activation_cases
from infinity.config import Config, ConfigError, IOConfig, TiersConfig
from infinity.store import TensorStore, Tier
from infinity.zero.activations import MIN_BYTES, ActivationOffload, ActivationOffloadError, SavedActivation, dense_flat

TIMEOUT_S = 120


def ok(per_rank) -> list:
    for rank, r in enumerate(per_rank):
        if "error" in r:
            pytest.fail(f"rank {rank} raised:\n{r['error']}", pytrace=False)
    return per_rank


def assert_same_run(r: dict, what: str) -> None:
    got, ref = r["got"], r["ref"]
    assert got["losses"] == ref["losses"], f"{what}: losses differ"
    if ref["params"] is not None:
        differ = [n for n in ref["params"] if not torch.equal(got["params"][n], ref["params"][n])]
        assert not differ, f"{what}: parameters not bitwise equal to keeping the activations: {differ}"
    assert all(n == 0 for n in got["pending"]), f"{what}: saved activations still held after a step: {got['pending']}"
    assert not any(got["leftover_keys"]), f"{what}: activation keys left in the store: {got['leftover_keys']}"
    stats = got["stats"]
    assert stats["saved_bytes"] > 0, f"{what}: nothing was offloaded"
    assert stats["restored_bytes"] == stats["saved_bytes"], f"{what}: not every saved activation came back once"


@pytest.mark.parametrize("tier", ("host", "nvme"))
@pytest.mark.parametrize("ckpt", (True, False), ids=("recompute", "no-recompute"))
@pytest.mark.parametrize("stage", (0, 3))
def test_offloaded_activations_train_bitwise_equal_world_1(worlds, tmp_path, stage, ckpt, tier):
    spec = dict(stage=stage, ckpt=ckpt, tier=tier, steps=3, tmp=str(tmp_path))
    r = ok(worlds(1).run(activation_cases.exact_case, spec, timeout_s=TIMEOUT_S))[0]
    assert_same_run(r, f"stage {stage}, {'recompute' if ckpt else 'no recompute'}, {tier}")
    per_step = r["got"]["stats"]["saved_bytes"] // 3
    inputs = activation_cases.BLOCKS * activation_cases.BATCH * activation_cases.SEQ * activation_cases.WIDTH * 4
    if ckpt:   # a checkpointed unit saves its input, nothing more
        assert per_step == inputs
    else:      # its input (once, though three ops save it), k transposed, the softmax, att @ h, ...
        assert per_step > 3 * inputs


@pytest.mark.parametrize("case", (
    dict(stage=1, ckpt=1, tier="nvme", accum=2),                       # the first unit recomputed, the rest not
    dict(stage=2, ckpt=True, tier="host", update_at="next_forward"),   # the overlapped update
    dict(stage=3, ckpt=True, tier="nvme", accum=2, update_at="backward"),
), ids=("stage1-accum-partial-ckpt", "stage2-next_forward", "stage3-accum-backward"))
def test_offload_with_accumulation_and_overlapped_update(worlds, tmp_path, case):
    spec = dict(case, steps=2, tmp=str(tmp_path))
    r = ok(worlds(1).run(activation_cases.exact_case, spec, timeout_s=TIMEOUT_S))[0]
    assert_same_run(r, str(case))


@pytest.mark.parametrize("ckpt,tier", ((True, "nvme"), (False, "host")))
@pytest.mark.parametrize("stage", (2, 3))
def test_offloaded_activations_train_bitwise_equal_world_2(worlds, tmp_path, stage, ckpt, tier):
    spec = dict(stage=stage, ckpt=ckpt, tier=tier, steps=2, tmp=str(tmp_path))
    for rank, r in enumerate(ok(worlds(2).run(activation_cases.exact_case, spec, timeout_s=TIMEOUT_S))):
        assert_same_run(r, f"rank {rank}, stage {stage}, {tier}")


def test_checkpoint_and_resume_are_unaffected(worlds, tmp_path):
    r = ok(worlds(2).run(activation_cases.resume_case, dict(tmp=str(tmp_path)), timeout_s=TIMEOUT_S))[0]
    assert r["off"]["losses"] == r["keep"]["losses"] and r["resumed"]["losses"] == r["keep"]["losses"][2:]
    for run in ("off", "resumed"):
        assert all(torch.equal(r[run]["params"][n], p) for n, p in r["keep"]["params"].items()), run


@pytest.mark.parametrize("sp", (False, True), ids=("tp2", "tp2-sp"))
def test_offload_under_tensor_and_sequence_parallelism(worlds, tmp_path, sp):
    """tp2 (world 2), the built-in GPT at stage 3: every saved tensor moved (the size floor lifted, as these
    activations are small) with and without recompute; bitwise the run that keeps them."""
    import tp_cases

    base = dict(model="gpt", steps=2, batch=8, lr=1e-2, stage=3, tp=2, sp=sp)
    specs = [base]
    for ckpt, tier in ((True, "nvme"), (False, "host")):
        specs.append(dict(base, activation_min_bytes=0, activations={
            "activation_checkpointing": ckpt, "activation_offload": tier, "nvme_path": str(tmp_path / f"{tier}")}))
    runs = worlds(2).run(tp_cases.many_tp, specs, timeout_s=TIMEOUT_S)[0]
    keep = runs[0]
    for spec, got in zip(specs[1:], runs[1:]):
        what = str(spec["activations"])
        assert got["activations"]["saved_bytes"] > 0 and \
            got["activations"]["restored_bytes"] == got["activations"]["saved_bytes"], what
        assert got["losses"] == keep["losses"], what
        assert all(torch.equal(got["params"][n], p) for n, p in keep["params"].items()), what


@pytest.mark.parametrize("fault,says", (("enospc", "No space left on device"),
                                        ("corrupt", "checksum")))
def test_a_failed_activation_write_or_read_is_one_line_and_the_step_runs_again(worlds, tmp_path, fault, says):
    spec = dict(stage=3, ckpt=True, tier="nvme", steps=3, fail_at=1, fault=fault, tmp=str(tmp_path))
    r = ok(worlds(1).run(activation_cases.failure_case, spec, timeout_s=TIMEOUT_S))[0]
    errors = r["got"]["errors"]
    assert len(errors) == 1 and errors[0].startswith("ActivationOffloadError: activation offload: "), errors
    assert says in errors[0] and "unit " in errors[0], errors[0]
    assert r["got"]["losses"] == r["ref"]["losses"]
    assert not any(r["got"]["leftover_keys"]) and not any(r["got"]["pending"]), "the failed forward's keys were kept"
    assert all(torch.equal(r["got"]["params"][n], p) for n, p in r["ref"]["params"].items()), \
        f"{fault}: the run after the failed micro-step does not end where the reference does"


def test_config_names_the_tier_and_needs_a_swap_directory_for_nvme():
    assert Config.from_dict({"zero": {"activation_offload": "host"}}).zero.activation_offload == "host"
    with pytest.raises(ConfigError, match=r"tiers\.nvme_path: required because zero\.activation_offload is 'nvme'"):
        Config.from_dict({"zero": {"activation_offload": "nvme"}})
    with pytest.raises(ConfigError, match="zero.activation_offload"):
        Config.from_dict({"zero": {"activation_offload": "disk"}})


# ---------------------------------------------------------------- the pieces, without an engine

def test_dense_flat_is_storage_order_for_permutations_and_none_for_gaps():
    x = torch.arange(24.0).reshape(2, 3, 4)
    assert torch.equal(dense_flat(x), torch.arange(24.0))
    t = x.transpose(0, 2)   # dense, permuted: the storage order is x's
    assert torch.equal(dense_flat(t), torch.arange(24.0))
    assert dense_flat(x[:, :, :2]) is None        # gaps
    assert dense_flat(torch.zeros(3).expand(4, 3)) is None   # overlapping (stride 0)
    assert torch.equal(dense_flat(x[1]), torch.arange(12.0, 24.0))   # an offset into the storage


class _Unit:
    def __init__(self, module):
        self.index, self.module = 0, module


@pytest.fixture(params=("host", "nvme"))
def offload(request, tmp_path):
    store = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=8 << 20, nvme_path=str(tmp_path)),
                        IOConfig(block_bytes=16384, queue_depth=4, threads=2))
    off = ActivationOffload(store, request.param, torch.device("cpu"), prefetch_bytes=1 << 20)
    yield off
    off.close()
    store.close()


def test_pack_and_unpack_rebuild_layout_and_bytes_and_release_the_key(offload):
    layer = torch.nn.Linear(64, 64)
    offload.begin_unit(_Unit(layer))
    base = torch.randn(64, 32, 16)
    permuted = base.permute(2, 0, 1)                 # dense, strides (1, 512, 16)
    mask = base > 0                                  # bool, 32 KiB: kept
    big_mask = torch.randn(128, 1024) > 0            # bool, 128 KiB: moved
    param = layer.weight                             # a parameter's storage: kept
    packed = [offload.pack(t) for t in (base, permuted, mask, big_mask, param, base)]
    offload.end_unit()
    assert isinstance(packed[0], SavedActivation) and isinstance(packed[1], SavedActivation)
    assert torch.equal(packed[2], mask) and packed[4] is param and isinstance(packed[3], SavedActivation)
    assert packed[5] is packed[0]                    # the same tensor saved twice is stored once
    assert offload.stats["saved_bytes"] == 2 * base.numel() * 4 + big_mask.numel()
    for original, handle in zip((base, permuted, big_mask), (packed[0], packed[1], packed[3])):
        back = offload.unpack(handle)
        assert back.stride() == original.stride() and back.dtype == original.dtype
        assert torch.equal(back, original) and back.data_ptr() != original.data_ptr()
    assert offload.unpack(packed[2]) is packed[2]
    assert offload.pending() == 3
    keys = [h.key for h in (packed[0], packed[1], packed[3])]
    del packed, handle
    assert offload.pending() == 0 and not any(k in offload.store for k in keys)
    assert offload.store.stats()["tier_bytes"]["host"] == 0


def test_a_forward_never_followed_by_backward_releases_its_keys(worlds, tmp_path):
    """An evaluation under grad, or a forward abandoned by an exception: once its outputs are dropped and the
    collector has run, every key it saved is released (what the hooks return keeps no graph alive for good)."""
    r = ok(worlds(1).run(activation_cases.abandoned_forward_case, dict(tmp=str(tmp_path)), timeout_s=TIMEOUT_S))[0]
    assert r["saved_bytes"] > 0 and r["pending_before"] > 0
    assert r["pending_after"] == 0 and r["keys_after"] == [], r


def test_prefetch_brings_the_next_two_units_saves_home_in_reverse_order(tmp_path):
    store = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=8 << 20, nvme_path=str(tmp_path)),
                        IOConfig(block_bytes=16384, queue_depth=4, threads=2))
    off = ActivationOffload(store, "nvme", torch.device("cpu"), prefetch_bytes=3 * MIN_BYTES)   # 2 units win
    try:
        module = torch.nn.Linear(2, 2)
        saved = []
        for i in range(5):
            off.begin_unit(_Unit(module))
            saved.append(off.pack(torch.full((MIN_BYTES // 4,), float(i))))
            off.end_unit()
        off._settle(wait=True)
        assert all(store.residency(h.key)[Tier.HOST].name == "ABSENT" for h in saved)   # on the disk only
        off.begin_backward()      # the last two units' (2 x MIN_BYTES, inside prefetch_bytes) come home first
        assert [h.brought is not None for h in saved] == [False, False, False, True, True]
        back = off.unpack(saved[4])
        assert torch.equal(back, torch.full((MIN_BYTES // 4,), 4.0))
        # the next two within the bytes; the one unpacked stays in host memory while autograd holds it
        assert [h.brought is not None for h in saved] == [False, False, True, True, True]
        for h in saved[:4]:
            store.wait(h.written)
    finally:
        off.close()
        store.close()


def test_a_write_that_failed_is_raised_at_the_units_end(tmp_path):
    import errno
    store = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=8 << 20, nvme_path=str(tmp_path)),
                        IOConfig(block_bytes=16384, queue_depth=4, threads=2))
    off = ActivationOffload(store, "nvme", torch.device("cpu"), prefetch_bytes=1 << 20)
    try:
        off.begin_unit(_Unit(torch.nn.Linear(2, 2)))
        first = off.pack(torch.zeros(MIN_BYTES // 4))   # opens the swap file
        store.wait(first.written)
        store._engine.syscalls.inject("pwritev", errno.ENOSPC, count=1)
        h = off.pack(torch.ones(MIN_BYTES // 4))
        with pytest.raises(ActivationOffloadError, match=r"writing unit 0's activation \(0\.1 MiB\) to nvme failed: "
                                                         r".*No space left on device"):
            try:
                store.wait(h.written)
            except Exception:
                pass
            off.end_unit()
        assert off._hooks is None   # the hooks are popped even so
    finally:
        store._engine.syscalls.clear()
        off.close()
        store.close()
