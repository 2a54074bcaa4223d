"""``infinity train``: the training loop, and starting the ranks that run it.

Files: ``options.py`` (defaults, :class:`TrainOptions`), ``resolve.py`` (validation
into the :class:`TrainRun` every rank runs), ``models.py`` (the ``--model`` grammar),
``launch.py`` (in-process, spawned or torchrun ranks; stopping), ``loop.py``
(one rank's loop, metrics, trace, progress).

With no options it trains :data:`DEFAULT_MODEL` (a small built-in GPT) on the
embedded default corpus with :func:`default_config` (ZeRO-3, optimizer and
parameters in NVMe files under ``./infinity_swap``). Everything else is an
option of :class:`TrainOptions`.

Ranks come from one of three places:

- ``nproc == 1``: this process is the only rank (no ``torch.distributed``);
- ``nproc > 1``: :func:`train` spawns that many local ranks (gloo on CPU, NCCL
  on CUDA, a free TCP port on localhost) and waits for them;
- under ``torchrun`` (``WORLD_SIZE`` set): this process is one rank of the
  launcher's group, and multi-node is torchrun's job.

Model names (``--model``), one grammar::

    NAME[:KEY=VALUE,...]          a built-in GPT (tiny, 125m, 350m, 1b, 3b), fields of GPTConfig changed
    hf:CLASS[:KEY=VALUE,...]      a transformers causal LM from its config class, e.g.
                                  hf:GPT2Config:n_layer=2,n_embd=64,n_head=2 (built from config, never downloaded)

VALUE is an integer, a float, ``true``/``false``, ``none`` or a bare string.
Tokens are bytes, so ``vocab_size`` defaults to 256 and may not be smaller.

Stopping: the first SIGINT (Ctrl-C) or SIGTERM asks every rank to stop after
the step it is in; all ranks agree on the stop in the same per-step
all-reduce that averages the loss, so none is left waiting in a collective.
Then each rank saves (with a save directory) and closes its engine, and the
launcher removes the per-run swap directory; exit 130 or 143. A second signal
stops at once (spawned ranks are killed; the swap directory is still
removed). Spawned ranks die with their launcher; see :mod:`infinity.train.launch`.
"""

from __future__ import annotations

import importlib

from infinity.train.errors import RankError, TrainError
from infinity.train.options import (DEFAULT_BATCH_SIZE, DEFAULT_MODEL, DEFAULT_OFFLOAD, DEFAULT_SEQ_LEN,
                                    DEFAULT_STEPS, DEFAULT_SWAP_DIR, TrainOptions, TrainResult, default_config)

__all__ = ["train", "TrainOptions", "TrainResult", "TrainError", "RankError", "ModelSpec", "parse_model_spec",
           "build_model", "default_config", "DEFAULT_MODEL", "DEFAULT_STEPS", "DEFAULT_BATCH_SIZE",
           "DEFAULT_SEQ_LEN", "DEFAULT_SWAP_DIR", "DEFAULT_OFFLOAD"]

# These import torch; loaded on first use so that `infinity --help` and the defaults above stay light.
_LAZY = {"train": "infinity.train.launch", "ModelSpec": "infinity.train.models",
         "parse_model_spec": "infinity.train.models", "build_model": "infinity.train.models"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'infinity.train' has no attribute {name!r}")
