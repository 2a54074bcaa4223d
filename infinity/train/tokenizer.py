"""The run's tokenizer: a local ``transformers`` tokenizer directory (nothing is downloaded), or byte tokens.

One loader for the three places that need it: the run (checked in the
launching process, before any rank starts), each rank (tokenizing ``--data``
and decoding ``--sample-every`` samples) and ``infinity sample`` (the run's
tokenizer, named in its job state). Each failure is a :class:`TrainError`
naming the directory.
"""

from __future__ import annotations

from pathlib import Path

from infinity.train.errors import TrainError

__all__ = ["load_tokenizer", "has_tokenizer_files", "TOKENIZER_FILES"]

# any of these makes a directory a tokenizer directory (an hf:PATH model's own tokenizer is found by them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def has_tokenizer_files(path) -> bool:
    p = Path(path).expanduser()
    return any((p / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | None, what: str = "--tokenizer"):
    """The tokenizer in directory ``path`` (local files only), or None for byte tokens when ``path`` is None.

    ``what`` names where the path came from in errors (the flag, or the checkpoint).
    """
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_dir():
        raise TrainError(f"{what} {path}: not a directory (a local transformers tokenizer; nothing is downloaded)")
    if not has_tokenizer_files(p):
        # transformers would build an empty tokenizer from a model's config.json alone
        raise TrainError(f"{what} {path}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); save one with "
                         "tokenizer.save_pretrained(DIR)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TrainError(f"{what} {path}: needs the transformers package") from None
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exception for a bad tokenizer.json
        first = (str(e).strip().splitlines() or [""])[0]
        raise TrainError(f"{what} {path}: cannot load a tokenizer there ({type(e).__name__}: {first})") from None
