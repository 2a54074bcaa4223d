"""The job's data (train split and held-out split, bytes or tokenized) and the validation loss.

The held-out split is the tail ``val_fraction`` of the token stream
(:meth:`infinity.data.TokenDataset.split`), so no training window overlaps
it. Evaluation runs ``eval_batches`` global batches of it, the same ones every
time (step ``i`` of the validation stream with the run's seed), each rank its
share, under ``model.eval()`` and ``torch.no_grad()``: the engine gathers
and releases units without recording them in its prefetch trace, and no
training state (gradients, optimizer, RNG) is touched.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from infinity.data import DEFAULT_CORPUS_BYTES, TokenDataset, stdlib_corpus, tokenize_text
from infinity.train.errors import RankError
from infinity.train.resolve import TrainRun
from infinity.train.sample import sample_text
from infinity.train.tokenizer import load_tokenizer

__all__ = ["make_datasets", "load_tokenizer", "evaluate", "sample_text"]


def make_datasets(run: TrainRun, tokenizer) -> tuple:
    """(train, val or None): ``--data`` or the default corpus, tokenized if there is a tokenizer."""
    if run.data is not None:
        raw = Path(run.data).read_bytes()
        name = run.data
    else:
        raw = stdlib_corpus(run.corpus_bytes or DEFAULT_CORPUS_BYTES)
        name = "python-stdlib"
    if tokenizer is not None:
        text = bytes(raw.numpy()) if isinstance(raw, torch.Tensor) else raw
        ids = tokenize_text(text.decode("utf-8", errors="replace"), tokenizer)
        # the run could not know the length in tokens: say it here, as the run does for bytes
        flag = f"--data {run.data}" if run.data is not None else "the default corpus"
        held_out = int(len(ids) * run.val_fraction)
        if len(ids) - held_out < run.seq_len + 1:
            raise RankError(f"{flag}: {len(ids)} tokens (tokenizer {run.tokenizer}) is too short for "
                            f"--seq-len {run.seq_len}")
        if run.val_fraction and held_out < run.seq_len + 1:
            raise RankError(f"{flag}: its held-out {run.val_fraction:g} ({held_out} tokens, tokenizer "
                            f"{run.tokenizer}) is too short for --seq-len {run.seq_len}; raise --val-fraction, or "
                            "hold nothing out with --val-fraction 0 --eval-every 0")
        data = TokenDataset(ids, run.seq_len, f"{name} ({len(ids)} tokens)")
    elif isinstance(raw, torch.Tensor):
        data = TokenDataset(raw, run.seq_len, name)
    else:
        data = TokenDataset(torch.frombuffer(bytearray(raw), dtype=torch.uint8), run.seq_len, name)
    if run.val_fraction <= 0.0:
        return data, None
    return data.split(run.val_fraction)


@torch.no_grad()
def evaluate(model, loss_fn, val: TokenDataset, run: TrainRun, rank: int, world_size: int, device) -> float:
    """Mean loss over ``run.eval_batches`` held-out global batches, averaged over ranks (every rank calls it).
    ``rank`` / ``world_size`` split the data (the data-parallel axis); the mean is over every rank, which under
    tensor parallelism counts each dp row's equal losses once per tp rank, the same mean."""
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(run.eval_batches):
            input_ids, labels = val.micro_batches(i, run.batch_size, run.seed, rank, world_size, 1)[0]
            total += loss_fn(model, input_ids.to(device), labels.to(device)).double()
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        if ranks > 1:
            dist.all_reduce(total)
        return float(total) / (run.eval_batches * ranks)
    finally:
        model.train(was_training)
