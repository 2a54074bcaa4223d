"""The default corpus and deterministic, rank-sharded byte-level batches.

The default corpus is real text that needs no download: the Python standard
library's own ``.py`` sources (``sysconfig.get_paths()["stdlib"]``, sorted by
relative path, ``site-packages`` skipped, concatenated and cut at a byte cap).
It is fixed for a given Python installation, not across Python versions.
Tokens are bytes: each uint8 is one token of a 256-entry vocab, so any file of
text (or anything else) can be fed instead with :meth:`TokenDataset.from_file`;
or the ids of a ``transformers`` tokenizer (:meth:`TokenDataset.tokenized`,
exactly its ids for the whole text, see :func:`tokenize_text`).

Batches are a pure function of ``(seed, step)``: step ``s`` of the global
batch draws ``batch_size`` window starts from ``numpy.random.default_rng([seed,
s])``. Rank ``r`` of ``N`` takes rows ``[r*B/N, (r+1)*B/N)``, split in order
into ``accum_steps`` micro-batches, so concatenating every rank's
micro-batches in rank order gives back the global batch exactly; a
one-process reference and an N-rank run see the same data.

Labels are the inputs shifted by one (``labels[:, t] == input_ids[:, t + 1]``
in the underlying text), the convention of :class:`infinity.models.GPT`, which
does not shift again.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = ["TokenDataset", "stdlib_corpus", "tokenize_text", "DEFAULT_CORPUS_BYTES", "VOCAB_SIZE"]

VOCAB_SIZE = 256
DEFAULT_CORPUS_BYTES = 4 * 2**20
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TOKEN_DTYPES = (torch.uint8, torch.int32, torch.int64)


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> torch.Tensor:
    """Up to ``max_bytes`` of the standard library's source, as a 1-D uint8 tensor."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"stdlib_corpus: max_bytes must be a positive integer, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    chunks, total_bytes = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # an unreadable file is skipped everywhere alike; order stays deterministic
        chunks.append(data)
        total_bytes += len(data)
        if total_bytes >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(
            f"default corpus: no readable .py files under the standard library at {root}; "
            "feed a text file instead (TokenDataset.from_file)")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


# tokenize_text: characters per tokenizer call, and how far each call reaches into its neighbours' text
TOKENIZE_PIECE_CHARS = 2**20
TOKENIZE_SEAM_CHARS = 2**12
_SEAM_TOKENS = 8   # tokens that must agree on each side of a join


def tokenize_text(text: str, tokenizer) -> torch.Tensor:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]`` as a 1-D int32 tensor, without one huge call.

    Cutting text anywhere changes its tokens near the cut (a run of newlines is
    one pre-token, a SentencePiece-style tokenizer marks every new start as a
    word start), so pieces are not simply concatenated. A fast tokenizer
    encodes pieces of ``TOKENIZE_PIECE_CHARS`` that reach ``TOKENIZE_SEAM_CHARS``
    into both neighbours; two neighbours are joined at a token both encoded
    alike (same id, same place in the text, and ``_SEAM_TOKENS`` more agreeing on
    each side), half a seam or more from either piece's end, where the text each
    lacks no longer matters. Where no such token exists (one pre-token longer
    than the seam) the piece is widened through its neighbour. A tokenizer
    without offsets (a slow one) encodes the text in one call.
    """
    n, piece, seam = len(text), TOKENIZE_PIECE_CHARS, TOKENIZE_SEAM_CHARS
    if n <= piece + seam or not getattr(tokenizer, "is_fast", False):
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int32)

    def encode(a: int, b: int) -> np.ndarray:   # rows (id, start, end), offsets into `text`
        enc = tokenizer(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
        rows = np.zeros((len(enc["input_ids"]), 3), dtype=np.int64)
        if len(rows):
            rows[:, 0] = enc["input_ids"]
            rows[:, 1:] = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2) + a
        return rows

    k = _SEAM_TOKENS
    done: list = []                  # ids already joined, in order
    a, b = 0, piece + seam           # the current piece's text; its rows from `first` on are not joined yet
    cur, first = encode(a, b), 0
    while b < n:
        mid = b - seam               # the seam: the next piece starts a seam before `mid`, this one ends after
        na, nb = mid - seam, min(n, mid + piece + seam)
        nxt = encode(na, nb)
        join = _join(cur, first, nxt, mid - seam // 2, mid + seam // 2, k)
        if join is None:             # no place where both agree: encode this piece through the next one
            run, b = cur[first:first + k], nb
            cur = encode(a, b)
            first = _find_run(cur, run)
            continue
        i, j = join
        done.append(cur[first:i, 0])
        a, b, cur, first = na, nb, nxt, j
    done.append(cur[first:, 0])
    return torch.from_numpy(np.concatenate(done).astype(np.int32))


def _join(cur: np.ndarray, first: int, nxt: np.ndarray, lo: int, hi: int, k: int):
    """``(i, j)``: ``cur[i]`` is ``nxt[j]``, a token starting in ``[lo, hi]``, ``k`` rows equal on each side."""
    index: dict = {}
    for j in np.nonzero((nxt[:, 1] >= lo) & (nxt[:, 1] <= hi))[0]:
        index.setdefault(tuple(nxt[j]), int(j))
    for i in np.nonzero((cur[:, 1] >= lo) & (cur[:, 1] <= hi))[0]:
        i = int(i)
        j = index.get(tuple(cur[i]))
        if j is None or i < max(first, k) or j < k or i + k > len(cur) or j + k > len(nxt):
            continue
        if np.array_equal(cur[i - k:i + k], nxt[j - k:j + k]):
            return i, j
    return None


def _find_run(rows: np.ndarray, run: np.ndarray) -> int:
    """Where ``run`` (rows of a shorter encoding of the same start of text) lies in ``rows``."""
    if len(run) == 0:
        return len(rows)
    for i in np.nonzero((rows == run[0]).all(axis=1))[0]:
        if np.array_equal(rows[i:i + len(run)], run):
            return int(i)
    raise RuntimeError("tokenize_text: a widened piece no longer encodes its start as before; this tokenizer's "
                       "output depends on text far ahead")


class TokenDataset:
    """A 1-D byte-token stream cut into ``(input_ids, labels)`` windows of ``seq_len``."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, name: str = "tokens"):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype not in _TOKEN_DTYPES:
            raise ValueError(f"TokenDataset({name}): expected a 1-D tensor of token ids (uint8 bytes, or int32 / "
                             "int64 ids from a tokenizer)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"TokenDataset({name}): seq_len must be a positive integer, got {seq_len!r}")
        if tokens.numel() < seq_len + 1:
            unit = "bytes" if tokens.dtype == torch.uint8 else "tokens"
            raise ValueError(
                f"TokenDataset({name}): {tokens.numel()} {unit} is too short for seq_len {seq_len} "
                f"(needs at least {seq_len + 1} {unit})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.name = name

    @classmethod
    def default(cls, seq_len: int, max_bytes: int = DEFAULT_CORPUS_BYTES) -> "TokenDataset":
        """The embedded default corpus: the standard library's source."""
        return cls(stdlib_corpus(max_bytes), seq_len, name="python-stdlib")

    @classmethod
    def from_file(cls, path: str | Path, seq_len: int) -> "TokenDataset":
        """Any file, read as bytes (text in any encoding works: tokens are bytes)."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise FileNotFoundError(f"cannot read data file {path}: {e.strerror or e}") from e
        return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                   torch.empty(0, dtype=torch.uint8), seq_len, name=str(path))

    @classmethod
    def tokenized(cls, data: bytes | torch.Tensor, tokenizer, seq_len: int, name: str) -> "TokenDataset":
        """Text (UTF-8 bytes, or a uint8 tensor of them) cut into ids by a ``transformers`` tokenizer.

        The ids are exactly ``tokenizer(text, add_special_tokens=False)["input_ids"]``
        (no BOS/EOS: the text is one stream), as int32, computed in bounded
        pieces (:func:`tokenize_text`).
        """
        raw = bytes(data.numpy()) if isinstance(data, torch.Tensor) else bytes(data)
        ids = tokenize_text(raw.decode("utf-8", errors="replace"), tokenizer)
        return cls(ids, seq_len, name=f"{name} ({ids.numel()} tokens)")

    def __len__(self) -> int:
        return self.tokens.numel()

    def split(self, val_fraction: float) -> tuple["TokenDataset", "TokenDataset"]:
        """(train, val): the head and the tail of the stream, so no window straddles both."""
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"TokenDataset({self.name}).split: val_fraction must be in (0, 1), got {val_fraction}")
        cut = len(self) - int(len(self) * val_fraction)
        return (TokenDataset(self.tokens[:cut], self.seq_len, f"{self.name}[train]"),
                TokenDataset(self.tokens[cut:], self.seq_len, f"{self.name}[val]"))

    def _starts(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        for what, v, lo in (("step", step, 0), ("seed", seed, 0), ("batch_size", batch_size, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"TokenDataset({self.name}): {what} must be an integer >= {lo}, got {v!r}")
        rng = np.random.default_rng([int(seed), int(step)])
        # highest start leaves room for seq_len inputs plus the one extra label byte
        return rng.integers(0, len(self) - self.seq_len, size=batch_size)

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(starts).unsqueeze(1) + torch.arange(self.seq_len + 1)   # (b, T+1)
        chunk = self.tokens[idx].long()
        return chunk[:, :-1], chunk[:, 1:]

    def global_batch(self, step: int, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step's batch, ``(batch_size, seq_len)`` int64 each: what one process would train on."""
        return self._windows(self._starts(step, batch_size, seed))

    def micro_batches(self, step: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                      accum_steps: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of step ``step``: ``accum_steps`` (input_ids, labels) pairs.

        Each is ``(batch_size // (world_size * accum_steps), seq_len)``; ``batch_size`` is the global batch.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"TokenDataset({self.name}): world_size must be an integer >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"TokenDataset({self.name}): rank must be in 0..{world_size - 1}, got {rank!r}")
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"TokenDataset({self.name}): accum_steps must be an integer >= 1, got {accum_steps!r}")
        parts = world_size * accum_steps
        if batch_size % parts:
            raise ValueError(
                f"TokenDataset({self.name}): global batch {batch_size} does not split evenly into "
                f"world_size {world_size} x accum_steps {accum_steps} = {parts} micro-batches")
        micro = batch_size // parts
        starts = self._starts(step, batch_size, seed)
        first = rank * accum_steps * micro
        return [self._windows(starts[first + i * micro: first + (i + 1) * micro]) for i in range(accum_steps)]

    def batch(self, step: int, batch_size: int, seed: int = 0, rank: int = 0,
              world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of step ``step`` as one micro-batch (no accumulation)."""
        return self.micro_batches(step, batch_size, seed, rank, world_size, accum_steps=1)[0]
