"""infinity: ZeRO stages 0-3 with device, host and NVMe tiers, for ordinary nn.Modules.

The public contract (DESIGN §1): :func:`initialize`, :func:`save_checkpoint`,
:func:`load_checkpoint`, :class:`Config`. Everything else is imported lazily so
``import infinity`` stays light.
"""

from infinity.config import Config, ConfigError

__all__ = ["Config", "ConfigError", "initialize", "engine_of", "save_checkpoint", "load_checkpoint"]
__version__ = "0.1.0"


def initialize(model, config=None, params=None, **kwargs):
    """See :func:`infinity.initialization.initialize`. A config with ``offload: auto`` (or ``"auto"``) is
    first resolved by the planner (:mod:`infinity.plan.auto`): the chosen config is logged on stderr
    and is the engine's config (so checkpoints save it)."""
    from infinity.initialization import initialize as _initialize
    from infinity.plan.auto import wants_auto
    if wants_auto(config):
        config = _plan_config(model, config)
    return _initialize(model, config, params, **kwargs)


def _plan_config(model, config):
    """The planner's config for ``model`` (rank 0 plans and logs; every rank gets rank 0's choice, so all
    build the same engine). A plan that fails on rank 0 raises there and, naming rank 0's error, on
    every other rank: none is left waiting for a config that never comes."""
    import os

    import torch.distributed as dist

    from infinity.plan.auto import log_plan, plan_for_module

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    chosen, failed = None, None
    if rank == 0:
        try:
            chosen, plan = plan_for_module(model, config, world)
            log_plan(plan)
        except Exception as e:   # the other ranks wait in the broadcast below: they are told, then it is raised
            if world <= 1 or not (dist.is_available() and dist.is_initialized()):
                raise
            failed = e
    if world > 1 and dist.is_available() and dist.is_initialized():
        box = [chosen, None if failed is None else f"{type(failed).__name__}: {failed}"]   # chosen: None if failed
        dist.broadcast_object_list(box, src=0)
        if failed is not None:
            raise failed
        if box[1] is not None:
            raise ConfigError(f"offload: auto: the planner failed on rank 0, which plans for every rank: {box[1]}")
        chosen = box[0]
    elif world > 1:
        raise ConfigError("offload: auto under a launcher needs torch.distributed initialized before "
                          "initialize (every rank must build the config rank 0 plans); or run `infinity plan` "
                          "and pass the config it prints")
    return chosen


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
