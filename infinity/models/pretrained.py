"""Fine-tuning a local ``transformers`` checkpoint that is larger than memory.

The model is built on the meta device (shapes only) and each unit is filled
straight from the checkpoint's safetensors files as the engine materializes
it, into its shards' home tiers, so the whole state dict is never in memory::

    import infinity
    from infinity.models.pretrained import initialize_pretrained

    model, optimizer = initialize_pretrained("path/to/gpt2-xl", "configs/zero3-nvme.yaml")

or, step by step (the same thing)::

    model = meta_model_from_pretrained(path)             # AutoModelForCausalLM.from_config on meta
    weights = SafetensorsWeights(path, model)            # checks every parameter has a tensor of its shape
    model, optimizer = infinity.initialize(model, config, init_fn=weights)

``path`` is a directory with ``config.json`` and ``model.safetensors``, or
shards listed by ``model.safetensors.index.json`` (what ``save_pretrained``
writes). Nothing is downloaded. Memory while loading: one unit's fp32 buffer
(plus the root unit: embeddings, final norm) and one tensor read from its
memory-mapped file, which is unmapped after each call. Tied weights (GPT-2's
``lm_head`` and ``wte``) are one parameter, read once under whichever of its
names the files hold; names with or without the model's
``base_model_prefix`` (``transformer.``) are both accepted.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn

__all__ = ["meta_model_from_pretrained", "SafetensorsWeights", "initialize_pretrained", "PretrainedError",
           "safetensors_files"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class PretrainedError(ValueError):
    """The directory is not a loadable local checkpoint, or does not match the model."""


def safetensors_files(directory) -> dict:
    """``{tensor name: file path}`` for a checkpoint directory (single file, or sharded with an index)."""
    d = Path(directory)
    if not d.is_dir():
        raise PretrainedError(f"{d}: not a directory (expected a local transformers model directory)")
    if (d / _INDEX).is_file():
        try:
            weight_map = json.loads((d / _INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PretrainedError(f"{d / _INDEX}: not a safetensors index ({type(e).__name__}: {e})") from None
        out = {}
        for name, fname in weight_map.items():
            path = d / fname
            if Path(fname).is_absolute() or path.resolve().parent != d.resolve():
                raise PretrainedError(f"{d / _INDEX}: file {fname!r} of {name!r} is not in {d}")
            if not path.is_file():
                raise PretrainedError(f"{d / _INDEX}: names {fname} for {name!r}, which is missing")
            out[name] = path
        return out
    if (d / _SINGLE).is_file():
        from safetensors import safe_open
        with safe_open(str(d / _SINGLE), framework="pt") as f:
            return {name: d / _SINGLE for name in f.keys()}
    found = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    hint = f" (found {', '.join(found)}; save it again with save_pretrained(..., safe_serialization=True))" \
        if found else ""
    raise PretrainedError(f"{d}: no {_SINGLE} or {_INDEX}{hint}")


def meta_model_from_pretrained(directory, **config_overrides) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``directory/config.json``, parameters on the meta device.

    ``use_cache`` is off (training). Buffers the files hold are read from them;
    computed ones (rotary ``inv_freq``) are rebuilt on the CPU by the module's
    own constructor, since :func:`infinity.initialize` materializes parameters only.
    """
    try:
        import transformers
    except ImportError:
        raise PretrainedError("loading a transformers model needs the transformers package") from None
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise PretrainedError(f"{d}: no config.json (expected a local transformers model directory)")
    try:
        config = transformers.AutoConfig.from_pretrained(str(d), local_files_only=True, **config_overrides)
    except (OSError, ValueError, KeyError) as e:
        raise PretrainedError(f"{d / 'config.json'}: {str(e).splitlines()[0]}") from None
    if hasattr(config, "use_cache"):
        config.use_cache = False
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, AttributeError) as e:
        raise PretrainedError(f"{d}: cannot build a causal LM from its config: {str(e).splitlines()[0]}") from None
    _real_buffers(model, d)
    return model


def _real_buffers(model: nn.Module, directory: Path) -> None:
    meta = [(name, b) for name, b in model.named_buffers() if b.is_meta]
    if not meta:
        return
    files = safetensors_files(directory)
    from safetensors import safe_open
    for name, _ in meta:
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if not owner._buffers[leaf].is_meta:
            continue   # rebuilt with an earlier buffer of the same module
        key = next((k for k in _candidates(name, model) if k in files), None)
        if key is not None:
            with safe_open(str(files[key]), framework="pt") as f:
                owner._buffers[leaf] = f.get_tensor(key)
            continue
        try:   # a computed, non-persistent buffer: let the module compute it again, on the CPU
            with torch.device("cpu"):
                fresh = type(owner)(model.config)
        except Exception as e:  # noqa: BLE001 - any failure means: we cannot recompute it
            raise PretrainedError(f"{directory}: buffer {name!r} is not in the files and {type(owner).__name__}"
                                  f"({type(model.config).__name__}) could not recompute it ({e})") from None
        for bname, value in fresh._buffers.items():
            if owner._buffers.get(bname) is not None and owner._buffers[bname].is_meta:
                owner._buffers[bname] = value


def _candidates(name: str, model: nn.Module) -> list:
    """``name`` as the model has it, and with its base_model_prefix stripped or added."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = [name]
    if prefix:
        out.append(name[len(prefix) + 1:] if name.startswith(prefix + ".") else f"{prefix}.{name}")
    return out


class SafetensorsWeights:
    """An ``init_fn`` for :func:`infinity.initialize` that copies parameters from safetensors files by name.

    Built before ``initialize``: checks that every parameter of ``model`` has
    a tensor of its shape in ``directory`` (a clear error naming the first that
    does not). Called on a module, copies those of its parameters that have
    storage and were not yet filled (descendants still on meta come in their
    own calls; a tied parameter is filled once), each file opened memory-mapped
    for the call and closed after it.
    """

    def __init__(self, directory, model: nn.Module):
        from safetensors import safe_open

        self.directory = Path(directory)
        files = safetensors_files(self.directory)
        self._key: dict = {}      # id(param) -> (tensor name, file)
        names: dict = defaultdict(list)
        for name, p in model.named_parameters(remove_duplicate=False):
            names[id(p)].append(name)
        shapes = {}
        for path in sorted(set(files.values())):
            with safe_open(str(path), framework="pt") as f:
                for k in f.keys():
                    shapes[k] = tuple(f.get_slice(k).get_shape())
        for name, p in model.named_parameters():
            tried = [c for n in names[id(p)] for c in _candidates(n, model)]
            key = next((k for k in tried if k in files), None)
            if key is None:
                raise PretrainedError(f"{self.directory}: no tensor for parameter {name!r} (tried "
                                      f"{', '.join(repr(t) for t in tried)})")
            if shapes[key] != tuple(p.shape):
                raise PretrainedError(f"{self.directory}: {key!r} has shape {list(shapes[key])}, the model's "
                                      f"{name!r} {list(p.shape)}; config.json and the weights disagree")
            self._key[id(p)] = (key, files[key])
        self._done: set = set()
        self.bytes_read = 0

    @torch.no_grad()
    def __call__(self, module: nn.Module) -> None:
        from safetensors import safe_open

        by_file: dict = defaultdict(list)
        for p in module.parameters():
            if p.is_meta or id(p) in self._done or id(p) not in self._key:
                continue
            key, path = self._key[id(p)]
            by_file[path].append((key, p))
        for path, items in by_file.items():
            with safe_open(str(path), framework="pt") as f:   # unmapped on close: its pages leave our RSS
                for key, p in items:
                    t = f.get_tensor(key)
                    p.copy_(t)
                    self.bytes_read += t.numel() * t.element_size()
                    del t
                    self._done.add(id(p))

    def missing(self, model: nn.Module) -> list:
        """Names of parameters not filled yet (empty after a complete ``initialize``)."""
        return [n for n, p in model.named_parameters() if id(p) not in self._done]


def initialize_pretrained(directory, config=None, params=None, **config_overrides):
    """Build the causal LM in ``directory`` on meta and ``infinity.initialize`` it from its safetensors files.

    Returns ``(model, optimizer)`` as :func:`infinity.initialize` does; the
    whole state dict is never in memory (see the module doc).
    """
    import infinity

    model = meta_model_from_pretrained(directory, **config_overrides)
    weights = SafetensorsWeights(directory, model)
    model, optimizer = infinity.initialize(model, config, params, init_fn=weights)
    left = weights.missing(model)
    if left:
        infinity.engine_of(model).close()
        raise PretrainedError(f"{directory}: parameter {left[0]!r} was never filled (initialize did not pass its "
                              "module to init_fn)")
    return model, optimizer
