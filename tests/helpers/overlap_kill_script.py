"""A process whose launched (next_forward) update is SIGKILLed half-way (see tests/zero/test_overlap_recipes.py).

``python overlap_kill_script.py MODE DIR``: MODE ``kill`` trains steps 0-1 (checkpoint after step 1) with
``update_at`` auto and clipping, then dies (SIGKILL, no cleanup) inside step 2's launched update, after one
unit's Adam ran; ``resume`` loads DIR's checkpoint in a new process and trains steps 2-3; ``straight`` trains
steps 0-3 without overlap. Both of the last two save their parameters to DIR/MODE.pt. A third argument
sets ``optimizer.update_at`` (default auto: next_forward); with ``speculative`` every step speculates, so
``kill`` dies inside step 2's speculative update, during its backward.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import infinity  # noqa: E402
import offload_cases  # noqa: E402
from zero_cases import global_batch  # noqa: E402

CLIP = 2.0


def main(mode: str, root: str, update_at: str = "auto") -> None:
    spec = dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host"), lr=1e-2,
                host_bytes=(192 + 124 + 64) * 1024, device_bytes=64 * 1024, prefetch_bytes=20 * 1024,
                tmp=os.path.join(root, f"swap-{mode}"))
    cfg = offload_cases.offload_config(spec, 0, 1)
    cfg["optimizer"]["update_at"] = update_at if mode != "straight" else "step"
    if update_at == "speculative":
        cfg["tiers"]["host_bytes"] = 640 * 1024   # the spares' working set: two copies of each state per job
    cfg["schedule"] = {"clip_grad_norm": CLIP}
    model, opt = infinity.initialize(offload_cases.build("gpt", 0), cfg)
    engine = infinity.engine_of(model)
    if engine.update.uses_spares:   # speculate on every step, clipped or not
        engine.update.speculation.speculate = lambda: True
    first = 0
    if mode == "resume":
        infinity.load_checkpoint(os.path.join(root, "ckpt"), model, opt)
        first = 2
    for step in range(first, 4):
        if mode == "kill" and step == 2:
            real, calls = engine.update.adam.step_, []

            def dying(*args, **kwargs):
                calls.append(1)
                if len(calls) == 2:   # one unit's state is already updated in memory, maybe on disk
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)
            engine.update.adam.step_ = dying
        ids = global_batch(step, 8)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        if mode == "kill" and step == 1:
            infinity.save_checkpoint(os.path.join(root, "ckpt"), model, opt)
    with engine.gathered():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.close()
    torch.save(params, os.path.join(root, f"{mode}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
