import sysconfig
from pathlib import Path

import pytest
import torch

from infinity.data import TokenDataset, stdlib_corpus


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus(256 * 1024)


def test_stdlib_corpus_is_real_source_deterministic_and_capped(corpus):
    assert corpus.dtype == torch.uint8 and corpus.numel() == 256 * 1024
    assert torch.equal(corpus, stdlib_corpus(256 * 1024))
    # it starts with the first stdlib .py file in sorted order
    root = Path(sysconfig.get_paths()["stdlib"])
    first = min((p for p in root.rglob("*.py") if "site-packages" not in p.parts),
                key=lambda p: p.relative_to(root).as_posix())
    head = first.read_bytes()[:1000]
    assert bytes(corpus[:len(head)].tolist()) == head
    text = bytes(corpus.tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert torch.equal(stdlib_corpus(1000), corpus[:1000])


def test_batches_are_shifted_windows_of_the_text(corpus):
    ds = TokenDataset(corpus, seq_len=32)
    x, y = ds.global_batch(step=3, batch_size=8, seed=1)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    text = bytes(corpus.tolist())
    for row_x, row_y in zip(x, y):
        window = bytes(row_x.tolist()) + bytes([int(row_y[-1])])   # inputs plus the last label byte
        assert window in text


def test_deterministic_in_seed_and_step(corpus):
    ds = TokenDataset(corpus, seq_len=16)
    a = ds.global_batch(step=5, batch_size=4, seed=0)
    assert torch.equal(a[0], ds.global_batch(step=5, batch_size=4, seed=0)[0])
    assert not torch.equal(a[0], ds.global_batch(step=6, batch_size=4, seed=0)[0])
    assert not torch.equal(a[0], ds.global_batch(step=5, batch_size=4, seed=1)[0])


@pytest.mark.parametrize("world_size,accum_steps", [(1, 1), (2, 1), (4, 1), (2, 3), (4, 2)])
def test_rank_shards_concatenate_to_the_global_batch(corpus, world_size, accum_steps):
    ds = TokenDataset(corpus, seq_len=16)
    B = 24
    gx, gy = ds.global_batch(step=11, batch_size=B, seed=4)
    xs, ys = [], []
    for rank in range(world_size):
        micros = ds.micro_batches(11, B, seed=4, rank=rank, world_size=world_size, accum_steps=accum_steps)
        assert len(micros) == accum_steps
        for x, y in micros:
            assert x.shape == (B // (world_size * accum_steps), 16)
            xs.append(x)
            ys.append(y)
    assert torch.equal(torch.cat(xs), gx) and torch.equal(torch.cat(ys), gy)
    if accum_steps == 1:
        assert torch.equal(ds.batch(11, B, seed=4, rank=world_size - 1, world_size=world_size)[0], xs[-1])


def test_uneven_split_and_bad_rank_are_errors(corpus):
    ds = TokenDataset(corpus, seq_len=16)
    with pytest.raises(ValueError, match="global batch 10 does not split evenly into world_size 4"):
        ds.micro_batches(0, 10, world_size=4)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        ds.batch(0, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        ds.batch(-1, 4)


def test_from_file_feeds_given_text(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("héllo wörld " * 20, encoding="utf-8")
    ds = TokenDataset.from_file(path, seq_len=8)
    assert len(ds) == len(path.read_bytes())
    x, y = ds.global_batch(0, 4)
    assert int(x.max()) <= 255 and int(x.min()) >= 0
    data = path.read_bytes()
    assert bytes(x[0].tolist()) in data


def test_from_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        TokenDataset.from_file(tmp_path / "missing.txt", seq_len=8)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"short.txt.*3 bytes is too short for seq_len 8"):
        TokenDataset.from_file(short, seq_len=8)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="0 bytes"):
        TokenDataset.from_file(empty, seq_len=8)


def test_split_head_and_tail(corpus):
    train, val = TokenDataset(corpus, seq_len=16).split(0.1)
    assert len(train) + len(val) == len(corpus)
    assert torch.equal(val.tokens, corpus[len(train):])
    with pytest.raises(ValueError, match="val_fraction"):
        TokenDataset(corpus, seq_len=16).split(1.5)


def test_default_dataset_trains_with_gpt():
    from infinity.models import GPT, gpt_config
    ds = TokenDataset.default(seq_len=32, max_bytes=64 * 1024)
    assert ds.name == "python-stdlib"
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    x, y = ds.batch(0, 4)
    loss = model(x, labels=y).loss
    assert 5.0 < loss.item() < 6.0   # ~ln(256) at init
