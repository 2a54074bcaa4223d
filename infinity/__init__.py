"""infinity: ZeRO stages 0-3 with device, host and NVMe tiers, for ordinary nn.Modules.

The public contract (DESIGN §1): :func:`initialize`, :func:`save_checkpoint`,
:func:`load_checkpoint`, :class:`Config`. Everything else is imported lazily so
``import infinity`` stays light.
"""

from infinity.config import Config, ConfigError

__all__ = ["Config", "ConfigError", "initialize", "engine_of", "save_checkpoint", "load_checkpoint"]
__version__ = "0.1.0"


def initialize(model, config=None, params=None, **kwargs):
    """See :func:`infinity.initialization.initialize`."""
    from infinity.initialization import initialize as _initialize
    return _initialize(model, config, params, **kwargs)


def engine_of(model):
    """See :func:`infinity.initialization.engine_of`."""
    from infinity.initialization import engine_of as _engine_of
    return _engine_of(model)


def save_checkpoint(directory, model, optimizer, **kwargs):
    """See :func:`infinity.checkpoint.save_checkpoint` (sharded, atomic)."""
    from infinity.checkpoint import save_checkpoint as _save
    return _save(directory, model, optimizer, **kwargs)


def load_checkpoint(directory, model, optimizer, **kwargs):
    """See :func:`infinity.checkpoint.load_checkpoint` (any world size and stage)."""
    from infinity.checkpoint import load_checkpoint as _load
    return _load(directory, model, optimizer, **kwargs)
