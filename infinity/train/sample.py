"""Sampling text from a model: ``infinity sample CKPT`` and ``infinity train --sample-every N``.

Both decode the same way: the prompt is encoded (UTF-8 bytes, or the run's
tokenizer), then each new token is drawn from the last position's logits over
the last ``max_len`` tokens (no key/value cache: the models are small or the
point is to watch learning, not speed), at ``temperature`` (0 = greedy) among
the ``top_k`` most likely, among the ids the tokenizer can decode (its
``len()``, which a model's padded vocab may exceed; 256 bytes without one).

``infinity sample`` loads a checkpoint saved by ``infinity train``: the job
state names the model and tokenizer; the weights are consolidated (streamed,
bounded memory) into a temporary directory and loaded into a plain model on
the CPU, so the model itself must fit in memory.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["generate", "sample_text", "sample_checkpoint", "encode", "decode"]

_BYTES = 256


def encode(text: str, tokenizer) -> list:
    """``text`` as token ids: the tokenizer's, or UTF-8 bytes."""
    if tokenizer is not None:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(text.encode("utf-8"))


def _vocab_limit(tokenizer) -> int:
    """Draw only ids the tokenizer decodes: a model's vocab may be padded past it (decode drops such ids)."""
    return len(tokenizer) if tokenizer is not None else _BYTES


def decode(ids: list, tokenizer) -> str:
    """Token ids back to text (undecodable bytes become U+FFFD)."""
    if tokenizer is not None:
        return tokenizer.decode(ids)
    return bytes(i for i in ids if 0 <= i < _BYTES).decode("utf-8", errors="replace")


@torch.no_grad()
def generate(model, prompt: list, tokens: int, max_len: int, *, temperature: float = 0.8, top_k: int | None = 40,
             generator: torch.Generator | None = None, vocab_limit: int | None = None, device="cpu",
             sync=None, progress=None) -> list:
    """``tokens`` new ids after ``prompt`` (a non-empty list of ids); returns only the new ones.

    ``vocab_limit`` restricts the draw to ids below it (256 for byte tokens).
    ``sync(tensor)`` (several ranks) makes every rank continue with the same id.
    ``progress()`` is called once per new token.
    """
    if not prompt:
        raise ValueError("generate: the prompt is empty; give at least one token")
    was_training = model.training
    model.eval()
    try:
        x = torch.tensor([prompt], dtype=torch.long, device=device)
        out = []
        for _ in range(tokens):
            logits = model(input_ids=x[:, -max_len:]).logits[:, -1, :].float()
            if vocab_limit is not None:
                logits = logits[:, :vocab_limit]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
            if sync is not None:
                nxt = sync(nxt)
            out.append(int(nxt))
            x = torch.cat([x[:, -max_len:], nxt], dim=1)   # only the window is ever read: memory stays bounded
            if progress is not None:
                progress()
        return out
    finally:
        model.train(was_training)


def sample_text(model, tokenizer, train_set, run, world_size: int, device, step: int) -> str:
    """In training: continue the first 16 tokens of the data for ``run.sample_tokens`` (every rank calls it)."""
    prompt = [int(t) for t in train_set.tokens[:16]]
    gen = torch.Generator().manual_seed(run.seed * 1_000_003 + step)   # never the training RNG

    def from_rank0(t):
        dist.broadcast(t, src=0)
        return t

    ids = generate(model, prompt, run.sample_tokens, run.seq_len, generator=gen, device=device,
                   vocab_limit=_vocab_limit(tokenizer),
                   sync=from_rank0 if world_size > 1 else None)
    return decode(prompt + ids, tokenizer)


def sample_checkpoint(checkpoint, prompt: str, tokens: int = 64, temperature: float = 0.8, top_k: int | None = 40,
                      seed: int = 0, say=None, progress=None) -> dict:
    """Load ``checkpoint`` (saved by ``infinity train``) and continue ``prompt``; returns the text and what ran.

    ``say(line)`` is told when the text will run past the model's positions (each token then sees only the
    last ones); ``progress(total)`` returns a per-token callback (a progress bar), or None."""
    from infinity.checkpoint import consolidate
    from infinity.train.job_state import read_job, resume_path
    from infinity.train.models import build_model, max_positions, parse_model_spec
    from infinity.train.tokenizer import load_tokenizer

    step_dir = resume_path(str(checkpoint), None)
    job = read_job(step_dir)
    spec = parse_model_spec(job["model"])
    tokenizer = load_tokenizer(job.get("tokenizer"), "the checkpoint's tokenizer")
    ids = encode(prompt, tokenizer)
    if not ids:
        raise ValueError("--prompt is empty; give some text to continue")
    tmp = Path(tempfile.mkdtemp(prefix="infinity-sample-"))
    try:
        consolidate(step_dir, tmp)
        model = _load_consolidated(spec, tmp, build_model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    max_len = max_positions(model) or int(job["seq_len"])
    if say is not None and len(ids) + tokens > max_len:
        say(f"{len(ids)} prompt + {tokens} new tokens run past the model's {max_len} positions: each new token "
            f"sees only the last {max_len}")
    gen = torch.Generator().manual_seed(seed)
    new = generate(model, ids, tokens, max_len, temperature=temperature, top_k=top_k, generator=gen,
                   vocab_limit=_vocab_limit(tokenizer), progress=progress(tokens) if progress else None)
    return {"checkpoint": str(step_dir), "model": spec.text, "step": int(job["next_step"]), "prompt": prompt,
            "text": decode(ids + new, tokenizer), "tokens": len(new)}


def _load_consolidated(spec, directory: Path, build_model):
    """A plain CPU model holding the consolidated weights in ``directory``."""
    if spec.kind in ("hf", "pretrained"):
        import transformers
        return transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    from safetensors.torch import load_file
    with torch.device("meta"):
        model, _ = build_model(spec, 1)
    model.to_empty(device="cpu")
    state = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(f)))
    model.load_state_dict(state)
    return model
