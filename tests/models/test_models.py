import math

import pytest
import torch
import torch.nn.functional as F

from infinity.models import GPT, Block, GPTConfig, gpt_config, gpt_init_


def _tiny(seed=0):
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny"))


def _unique_numel(model):
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("name,expected", [("125m", 125e6), ("350m", 350e6), ("1b", 1e9), ("3b", 3e9)])
def test_named_sizes_hold_within_15_percent(name, expected):
    with torch.device("meta"):
        model = GPT(gpt_config(name))
    n = _unique_numel(model)
    assert abs(n - expected) / expected <= 0.15, f"{name}: {n} params"


def test_tiny_shape_and_exact_count():
    cfg = gpt_config("tiny")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size) == (2, 64, 4, 256, 64)
    C, V, L, T = 64, 256, 2, 64
    per_block = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C) + 4 * C
    assert _unique_numel(_tiny()) == V * C + T * C + L * per_block + 2 * C


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown GPT size '7q'.*tiny, 125m, 350m, 1b, 3b"):
        gpt_config("7q")


def test_bad_config_values_are_rejected():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)


def test_structure_and_tied_weights():
    model = _tiny()
    assert isinstance(model.transformer.h, torch.nn.ModuleList)
    assert all(isinstance(b, Block) for b in model.transformer.h) and len(model.transformer.h) == 2
    assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, 256, (2, 8))
    model(x, labels=x).loss.backward()
    assert model.transformer.wte.weight.grad is model.lm_head.weight.grad
    # the tied gradient has both contributions: rows of tokens never seen in x still get output-side grad
    unseen = sorted(set(range(256)) - set(x.flatten().tolist()))[0]
    assert model.transformer.wte.weight.grad[unseen].abs().sum() > 0


def test_deterministic_given_seed_and_different_across_seeds():
    a, b, c = _tiny(1), _tiny(1), _tiny(2)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)


def test_init_statistics():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=64)
    model = GPT(cfg)
    block = model.transformer.h[0]
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.002
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for w in (block.attn.c_proj.weight, block.mlp.c_proj.weight):
        assert abs(w.std().item() - proj_std) < 0.1 * proj_std
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.002
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        if ".ln_" in name and name.endswith("weight"):
            assert torch.all(p == 1), name


def test_meta_model_initialized_unit_by_unit_equals_eager():
    cfg = gpt_config("tiny")
    torch.manual_seed(7)
    eager = GPT(cfg)
    with torch.device("meta"):
        lazy = GPT(cfg)
    assert all(p.is_meta for p in lazy.parameters())
    torch.manual_seed(7)
    t = lazy.transformer
    units = [t.wte, t.wpe, t.ln_f] + list(t.h)   # the documented order
    for unit in units:
        unit.to_empty(device="cpu")
        gpt_init_(unit, cfg)
    lazy.lm_head.weight = t.wte.weight
    eager_sd, lazy_sd = eager.state_dict(), lazy.state_dict()
    assert eager_sd.keys() == lazy_sd.keys()
    for k in eager_sd:
        assert torch.equal(eager_sd[k], lazy_sd[k]), k


def test_loss_is_mean_cross_entropy_on_given_labels_without_shift():
    model = _tiny()
    tokens = torch.randint(0, 256, (3, 17))
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = model(x, labels=y)
    assert out.logits.shape == (3, 16, 256)
    expected = F.cross_entropy(out.logits.reshape(-1, 256), y.reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert model(x).loss is None
    masked = y.clone()
    masked[:, :8] = -100
    expected_masked = F.cross_entropy(out.logits[:, 8:].reshape(-1, 256), y[:, 8:].reshape(-1))
    torch.testing.assert_close(model(x, labels=masked).loss, expected_masked)


def test_attention_is_causal():
    model = _tiny()
    x = torch.randint(0, 256, (1, 12))
    x2 = x.clone()
    x2[0, 8:] = (x2[0, 8:] + 1) % 256
    a, b = model(x).logits, model(x2).logits
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_too_long_sequence_and_bad_labels_raise():
    model = _tiny()
    with pytest.raises(ValueError, match="exceeds block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    x = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="labels shape"):
        model(x, labels=torch.zeros(1, 7, dtype=torch.long))


def test_tiny_learns_a_repeating_sequence():
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.arange(33).repeat(4, 1) % 11
    x, y = tokens[:, :-1], tokens[:, 1:]
    first = model(x, labels=y).loss.item()
    for _ in range(60):
        loss = model(x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 5.0 and loss.item() < 0.5
