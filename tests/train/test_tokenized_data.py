"""``--data`` as text cut by a local transformers tokenizer: the ``hf:PATH`` model's own, or ``--tokenizer DIR``.

Everything is built here, with no network: a byte-level BPE (GPT-2 style) trained with the ``tokenizers``
library on a few KB of text, wrapped as ``transformers.PreTrainedTokenizerFast`` and saved with
``save_pretrained``, and a tiny GPT-2 of the same vocab saved beside it.
"""

from __future__ import annotations

import ast
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import infinity.data  # noqa: E402
from infinity.cli import main  # noqa: E402
from infinity.data import TokenDataset, tokenize_text  # noqa: E402
from infinity.train import loop as train_loop  # noqa: E402
from infinity.train.job_state import read_job, resume_path  # noqa: E402

SEQ = 32
RUN = ["--steps", "2", "--batch-size", "2", "--seq-len", str(SEQ), "--lr", "1e-3", "--no-progress", "--seed", "3"]


def _text(lines: int = 240, seed: int = 0) -> str:
    """A few KB of deterministic text with what makes cutting it hard: runs of blank lines, indentation, digits."""
    rng = random.Random(seed)
    words = ("the unit is gathered before its forward and released after its backward while each shard keeps "
             "its own optimizer state on the host or on nvme").split()
    out = []
    for i in range(lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
        out.append(" " * (4 * rng.randint(0, 2)) + line + (f" {i * 37}" if i % 5 == 0 else "") + "." +
                   "\n" * rng.choice((1, 1, 1, 2, 3)))
    return "".join(out)


def _byte_bpe(text: str, vocab: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _metaspace_bpe(text: str):
    """SentencePiece-style (as Llama's): a word-start mark prepended to the text, spaces as marks."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"],
                                                        show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _word_level(text: str):
    """One token per whitespace-separated word ([UNK] for a new one, however long)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _save_gpt2(path: Path, vocab: int) -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=vocab,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """text.txt; its tokenizer; gpt2-tok (a GPT-2 with that tokenizer saved in it); gpt2 (the model alone)."""
    root = tmp_path_factory.mktemp("tokenized")
    text = _text()
    (root / "text.txt").write_text(text, encoding="utf-8")
    tok = _byte_bpe(text)
    _save_gpt2(root / "gpt2", len(tok))
    shutil.copytree(root / "gpt2", root / "gpt2-tok")
    tok.save_pretrained(root / "gpt2-tok")
    return root, text, tok


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the default swap directory lives in the working directory


@pytest.fixture
def fed(monkeypatch):
    """What the job trains on: the datasets it builds and every micro-batch it draws (dataset, step, batch)."""
    seen = {"datasets": [], "batches": []}
    make_datasets = train_loop.make_datasets

    def spy_make_datasets(run, tokenizer):
        out = make_datasets(run, tokenizer)
        seen["datasets"].append(out)
        return out

    micro_batches = TokenDataset.micro_batches

    def spy_micro_batches(self, step, *args, **kwargs):
        out = micro_batches(self, step, *args, **kwargs)
        seen["batches"].append((self, step, out))
        return out

    monkeypatch.setattr(train_loop, "make_datasets", spy_make_datasets)
    monkeypatch.setattr(TokenDataset, "micro_batches", spy_micro_batches)
    return seen


# ---------------------------------------------------------------- the ids the job trains on

@pytest.mark.parametrize("source", ["model-dir", "flag"])
def test_job_trains_on_the_tokenizers_ids(source, files, fed, tmp_path, capsys):
    root, text, tok = files
    if source == "model-dir":   # found in the hf:PATH directory by itself
        tok_dir, args = root / "gpt2-tok", ["--model", f"hf:{root / 'gpt2-tok'}"]
    else:                       # a model directory without one, and --tokenizer DIR
        tok_dir = tmp_path / "tok"
        tok.save_pretrained(tok_dir)
        args = ["--model", f"hf:{root / 'gpt2'}", "--tokenizer", str(tok_dir)]
    want = tok(text)["input_ids"]
    assert want == tok(text, add_special_tokens=False)["input_ids"]   # this tokenizer adds no BOS/EOS
    assert max(want) >= 256 and len(want) < 0.6 * len(text.encode())   # merged tokens: not bytes

    rc = main(["train", *args, *RUN, "--data", str(root / "text.txt"), "--save-dir", "ck", "--eval-every", "2",
               "--sample-every", "2", "--sample-tokens", "8", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err

    (train, val), = fed["datasets"]
    assert train.tokens.dtype == torch.int32 and val is not None
    assert torch.cat([train.tokens, val.tokens]).tolist() == want   # every id, in order, none added
    assert len(val) == int(len(want) * 0.05)
    trained = [(ds, step, mb) for ds, step, mb in fed["batches"] if ds is train]
    assert [step for _, step, _ in trained] == [0, 1]
    for ds, step, ((input_ids, labels),) in trained:   # each row is a window of the ids, labels one further
        assert input_ids.shape == (2, SEQ)
        for row, label, start in zip(input_ids.tolist(), labels.tolist(), ds._starts(step, 2, 3)):
            assert row == want[start:start + SEQ] and label == want[start + 1:start + SEQ + 1]
    assert any(ds is val for ds, _, _ in fed["batches"])   # evaluated on the held-out ids

    # --sample-every continues the data's first 16 tokens and decodes with the tokenizer, not as bytes
    line, = (ln for ln in err.splitlines() if ln.startswith("step 2 sample: "))
    assert ast.literal_eval(line[len("step 2 sample: "):]).startswith(tok.decode(want[:16]))
    summary = json.loads(out)
    assert summary["val_loss"] is not None
    job = read_job(resume_path("ck", None))
    assert job["tokenizer"] == str(tok_dir.resolve())

    # infinity sample: the prompt through the tokenizer (it merges: bytes would not give it back), decoded by it
    prompt = "the unit is gathered"
    assert len(tok(prompt)["input_ids"]) < len(prompt.encode()) and max(tok(prompt)["input_ids"]) >= 256
    assert main(["sample", "ck", "--prompt", prompt, "--tokens", "8", "--json"]) == 0
    sample = json.loads(capsys.readouterr().out)
    assert sample["text"].startswith(prompt) and sample["tokens"] == 8 and sample["step"] == 2

    if source == "flag":   # the run's tokenizer is named by its job state: gone, it is named in the error
        tok_dir.rename(tmp_path / "moved")
        assert main(["sample", "ck", "--prompt", prompt]) == 2
        assert f"the checkpoint's tokenizer {tok_dir.resolve()}: not a directory" in capsys.readouterr().err


def test_samples_draw_only_ids_the_tokenizer_decodes(files, tmp_path, capsys):
    """A model whose vocab is padded past the tokenizer (as GPT-2's 50257 to 50304) never samples the padding."""
    root, text, tok = files
    padded = tmp_path / "padded"
    _save_gpt2(padded, len(tok) + 700)   # untrained: most of the draw would land in the padding
    tok.save_pretrained(padded)
    rc = main(["train", "--model", f"hf:{padded}", *RUN, "--data", str(root / "text.txt"), "--save-dir", "ck",
               "--eval-every", "0"])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    from infinity.train import sample as sample_mod
    drawn = []
    generate = sample_mod.generate

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        drawn.extend(out)
        return out

    sample_mod.generate = spy
    try:
        assert main(["sample", "ck", "--prompt", "the unit", "--tokens", "32", "--temperature", "2", "--json"]) == 0
    finally:
        sample_mod.generate = generate
    assert len(drawn) == 32 and max(drawn) < len(tok)


# ---------------------------------------------------------------- long text: pieces joined exactly

class _Counting:
    """A tokenizer that counts its calls."""

    def __init__(self, tok):
        self.tok, self.calls, self.is_fast = tok, 0, tok.is_fast

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tok(*args, **kwargs)


@pytest.mark.parametrize("kind", ["byte-bpe", "metaspace-bpe", "word-level"])
def test_long_text_is_tokenized_in_pieces_exactly_as_in_one_call(kind, monkeypatch):
    text = _text(lines=400, seed=1)
    tok = {"byte-bpe": _byte_bpe, "metaspace-bpe": _metaspace_bpe, "word-level": _word_level}[kind](text)
    if kind == "word-level":   # one word longer than a seam: both pieces cut it, so the piece must widen
        rng = random.Random(2)
        text = text[:3000] + "".join(rng.choice("abcdefgh") for _ in range(700)) + text[3000:]
    piece = 500
    monkeypatch.setattr(infinity.data, "TOKENIZE_PIECE_CHARS", piece)
    monkeypatch.setattr(infinity.data, "TOKENIZE_SEAM_CHARS", 64)
    want = tok(text)["input_ids"]
    counting = _Counting(tok)
    got = tokenize_text(text, counting)
    assert got.dtype == torch.int32 and got.tolist() == want
    assert counting.calls >= len(text) // piece   # in pieces, not one call
    if kind != "word-level":   # what joining the pieces' ids as they come would give: not the same
        naive = [i for a in range(0, len(text), piece) for i in tok(text[a:a + piece])["input_ids"]]
        assert naive != want
    # text that fits one piece: one call
    short = _Counting(tok)
    assert tokenize_text(text[:piece], short).tolist() == tok(text[:piece])["input_ids"] and short.calls == 1


# ---------------------------------------------------------------- errors name the path

def test_missing_or_invalid_tokenizer_is_named(files, tmp_path, capsys):
    root, text, tok = files
    data = ["--data", str(root / "text.txt"), *RUN, "--no-save"]
    model = ["--model", f"hf:{root / 'gpt2'}"]

    def refused(*argv) -> str:
        rc = main(["train", *argv])
        err = capsys.readouterr().err
        assert rc == 2, err
        return err

    missing = tmp_path / "missing"
    assert f"--tokenizer {missing}: not a directory" in refused(*model, "--tokenizer", str(missing), *data)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"--tokenizer {empty}: no tokenizer there" in refused(*model, "--tokenizer", str(empty), *data)
    # a model directory without a tokenizer (transformers alone would make an empty one from its config.json)
    assert f"--tokenizer {root / 'gpt2'}: no tokenizer there" in refused(*model, "--tokenizer", str(root / "gpt2"),
                                                                         *data)
    for name, content in (("garbled", "{not json"), ("fieldless", "{}")):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "tokenizer.json").write_text(content)
        assert f"--tokenizer {bad}: cannot load a tokenizer there (" in refused(*model, "--tokenizer", str(bad),
                                                                                *data)
        broken_model = tmp_path / f"model-{name}"   # the model directory's own tokenizer, broken
        shutil.copytree(root / "gpt2", broken_model)
        shutil.copy(bad / "tokenizer.json", broken_model)
        assert f"the model's tokenizer {broken_model}: cannot load" in refused("--model", f"hf:{broken_model}", *data)
    # more tokens than the model has embeddings
    assert f"--tokenizer {root / 'gpt2-tok'}: 300 tokens, more than the model's vocab_size 256" in \
        refused("--model", "tiny", "--tokenizer", str(root / "gpt2-tok"), *data)

    # text too short once tokenized: the run cannot know, the rank says so
    short = tmp_path / "short.txt"
    short.write_text(text[:40])
    rc = main(["train", *model, "--tokenizer", str(root / "gpt2-tok"), "--data", str(short), *RUN, "--no-save",
               "--val-fraction", "0", "--eval-every", "0"])
    err = capsys.readouterr().err
    n = len(tok(text[:40])["input_ids"])
    assert rc == 1 and f"--data {short}: {n} tokens (tokenizer {(root / 'gpt2-tok').resolve()}) is too short " \
                       f"for --seq-len {SEQ}" in err, err
