"""``--model``: the grammar, and building the model it names with its loss.

One grammar::

    NAME[:KEY=VALUE,...]          a built-in GPT (tiny, 125m, 350m, 1b, 3b), fields of GPTConfig changed
    hf:CLASS[:KEY=VALUE,...]      a transformers causal LM from its config class, e.g.
                                  hf:GPT2Config:n_layer=2,n_embd=64,n_head=2 (built from config, never downloaded)
    hf:PATH                       a local transformers model directory (config.json + safetensors): its
                                  pretrained weights, loaded unit by unit (see infinity/models/pretrained.py)

VALUE is an integer, a float, ``true``/``false``, ``none`` or a bare string.
Tokens are bytes, so ``vocab_size`` defaults to 256 and may not be smaller.
Labels from :mod:`infinity.data` are already shifted; both losses use them as
they are (a transformers model is not given ``labels=``, which it would shift
again).
"""

from __future__ import annotations

import math

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from infinity.train.errors import TrainError

__all__ = ["ModelSpec", "parse_model_spec", "build_model", "unit_init_fn", "max_positions", "LossFn"]


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--model``: ``kind`` is "gpt" (``name`` a built-in size), "hf" (``name`` a config class) or
    "pretrained" (``name`` the absolute path of a local transformers model directory)."""

    kind: str
    name: str
    overrides: tuple        # ((key, value), ...) in the order given
    text: str


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            value = cast(text)
        except ValueError:
            continue
        if not math.isfinite(value):   # "nan" and "inf" read as floats; no model field wants one
            raise TrainError(f"--model: {text!r} is not a finite number")
        return value
    return text


def parse_model_spec(text: str) -> ModelSpec:
    """``"tiny"``, ``"125m:n_layer=4"`` or ``"hf:GPT2Config:n_layer=2,n_embd=64"`` -> :class:`ModelSpec`."""
    from infinity.models import GPT_SIZES

    if not isinstance(text, str) or not text.strip():
        raise TrainError("--model: empty model name")
    parts = text.strip().split(":")
    if parts[0].lower() == "hf" and _looks_like_path(text.strip()[3:]):
        path = Path(text.strip()[3:]).expanduser()
        if not path.is_dir():
            raise TrainError(f"--model {text!r}: {path} is not a directory (expected a local transformers model "
                             "directory with config.json and safetensors weights; nothing is downloaded)")
        return ModelSpec("pretrained", str(path.resolve()), (), text.strip())
    if parts[0].lower() == "hf":
        if len(parts) not in (2, 3) or not parts[1]:
            raise TrainError(f"--model {text!r}: expected hf:CONFIG_CLASS[:KEY=VALUE,...], "
                             "e.g. hf:GPT2Config:n_layer=2,n_embd=64,n_head=2")
        kind, name, rest = "hf", parts[1], parts[2] if len(parts) == 3 else ""
    else:
        if len(parts) > 2:
            raise TrainError(f"--model {text!r}: expected NAME[:KEY=VALUE,...] or hf:CONFIG_CLASS[:KEY=VALUE,...]")
        kind, name, rest = "gpt", parts[0].lower(), parts[1] if len(parts) == 2 else ""
        if name not in GPT_SIZES:
            raise TrainError(f"--model: unknown model {parts[0]!r}; built-in GPT sizes: {', '.join(GPT_SIZES)}, "
                             "or hf:CONFIG_CLASS[:KEY=VALUE,...] for a transformers model")
    overrides = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise TrainError(f"--model {text!r}: {item!r} is not KEY=VALUE")
        overrides.append((key.strip(), _parse_value(value.strip())))
    keys = [k for k, _ in overrides]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup:
        raise TrainError(f"--model {text!r}: {dup} is given twice")
    return ModelSpec(kind, name, tuple(overrides), text.strip())


def _looks_like_path(text: str) -> bool:
    """``hf:`` followed by a directory (``./gpt2``, ``/models/gpt2``, ``~/gpt2``, an existing name) rather than
    a config class name."""
    return "/" in text or text.startswith((".", "~")) or (bool(text) and Path(text).is_dir())


LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def build_model(spec: ModelSpec, seq_len: int) -> tuple[torch.nn.Module, LossFn]:
    """The model ``spec`` names (on the current default device; ``torch.device("meta")`` to only check it) and
    its loss: ``loss_fn(model, input_ids, labels)``, mean cross-entropy against already-shifted labels."""
    if spec.kind == "gpt":
        return _build_gpt(spec, seq_len), _gpt_loss
    if spec.kind == "pretrained":
        return _build_pretrained(spec, seq_len), _hf_loss
    return _build_hf(spec, seq_len), _hf_loss


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence ``model`` takes (a GPT's block_size, a transformers config's positions), if it says."""
    cfg = getattr(model, "config", None)
    for key in ("block_size", "n_positions", "max_position_embeddings"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _build_pretrained(spec: ModelSpec, seq_len: int) -> torch.nn.Module:
    from infinity.models.pretrained import PretrainedError, meta_model_from_pretrained

    try:
        model = meta_model_from_pretrained(spec.name)
    except PretrainedError as e:
        raise TrainError(f"--model {spec.text!r}: {e}") from None
    positions = max_positions(model)
    if positions is not None and seq_len > positions:
        raise TrainError(f"--seq-len {seq_len} exceeds the model's {positions} positions ({spec.name})")
    return model


def _build_gpt(spec: ModelSpec, seq_len: int) -> torch.nn.Module:
    from infinity.models import GPT, gpt_config

    base = gpt_config(spec.name)
    valid = [f.name for f in dataclasses.fields(base)]
    bad = next((k for k, _ in spec.overrides if k not in valid), None)
    if bad:
        raise TrainError(f"--model {spec.text!r}: GPTConfig has no field {bad!r}; valid: {', '.join(valid)}")
    try:
        cfg = dataclasses.replace(base, **dict(spec.overrides))
    except ValueError as e:
        raise TrainError(f"--model {spec.text!r}: {e}") from None
    if cfg.vocab_size < 256:
        raise TrainError(f"--model {spec.text!r}: vocab_size {cfg.vocab_size} < 256; tokens are bytes (0..255)")
    if seq_len > cfg.block_size:
        raise TrainError(f"--seq-len {seq_len} exceeds the model's block_size {cfg.block_size}; "
                         f"lower --seq-len or set block_size in --model (e.g. {spec.name}:block_size={seq_len})")
    return GPT(cfg)


def _build_hf(spec: ModelSpec, seq_len: int) -> torch.nn.Module:
    try:
        import transformers
    except ImportError:
        raise TrainError(f"--model {spec.text!r}: needs the transformers package (pip install transformers)") from None
    cls = getattr(transformers, spec.name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        raise TrainError(f"--model {spec.text!r}: transformers has no config class {spec.name!r} "
                         "(expected a name like GPT2Config or LlamaConfig)")
    defaults = cls()
    known = set(vars(defaults)) | set(getattr(cls, "attribute_map", {}))
    # PretrainedConfig keeps any unknown keyword as an attribute; a typo would silently do nothing
    bad = next((k for k, _ in spec.overrides if k not in known), None)
    if bad:
        raise TrainError(f"--model {spec.text!r}: {spec.name} has no field {bad!r}")
    kwargs = dict(spec.overrides)
    kwargs.setdefault("vocab_size", 256)
    if "use_cache" in known:
        kwargs["use_cache"] = False   # training: no key/value cache to keep
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        # defaults name ids of the class's own tokenizer (GPT-2: 50256), outside a byte vocab; none are used here
        value = getattr(defaults, key, None)
        if key not in kwargs and isinstance(value, int) and not 0 <= value < kwargs["vocab_size"]:
            kwargs[key] = None
    try:
        cfg = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise TrainError(f"--model {spec.text!r}: {e}") from None
    if cfg.vocab_size < 256:
        raise TrainError(f"--model {spec.text!r}: vocab_size {cfg.vocab_size} < 256; tokens are bytes (0..255)")
    positions = next((getattr(cfg, k) for k in ("n_positions", "max_position_embeddings")
                      if isinstance(getattr(cfg, k, None), int)), None)
    if positions is not None and seq_len > positions:
        raise TrainError(f"--seq-len {seq_len} exceeds {spec.name}'s {positions} positions")
    try:
        return transformers.AutoModelForCausalLM.from_config(cfg)
    except (ValueError, TypeError, AttributeError) as e:
        raise TrainError(f"--model {spec.text!r}: cannot build a causal LM from {spec.name}: "
                         f"{str(e).splitlines()[0]}") from None


def unit_init_fn(model: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """For a built-in GPT, the initializer the engine runs on each unit of the model built on the meta
    device (``gpt_init_`` draws exactly what ``GPT(cfg)`` draws, one unit at a time); None otherwise."""
    from infinity.models import GPT, gpt_init_

    if isinstance(model, GPT):
        return functools.partial(gpt_init_, cfg=model.config)
    return None


def _gpt_loss(model, input_ids, labels):
    return model(input_ids, labels=labels).loss


def _hf_loss(model, input_ids, labels):
    # our labels are already shifted; passing labels= would make the model shift them again
    logits = model(input_ids=input_ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
