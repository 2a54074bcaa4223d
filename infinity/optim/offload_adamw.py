"""AdamW whose step runs the pipelined CPU Adam over offloaded shards.

Same user-facing optimizer as :class:`ShardedAdamW` (real ``param_groups``,
per-group step counts, ``clip_grad_norm_``), but ``step`` asks its source for
one :class:`~infinity.optim.offload_pipeline.ShardJob` per shard and runs them
through :class:`~infinity.optim.offload_pipeline.AdamPipeline`: swap-in of the
next shard, the update of this one and the write-back of the last overlap.
The update is :class:`CpuAdamW` (torch's fused AdamW kernel, chunked across
``optimizer.threads`` threads) with the low-precision parameter written in the
same pass.

The source (the offload engine) provides ``store``, ``tracer``,
``shard_jobs()`` and ``record_optimizer_stats(stats)`` besides the
:class:`ShardSource` protocol; this module knows nothing of ZeRO.
"""

from __future__ import annotations

from infinity.optim.cpu_adam import CpuAdamW
from infinity.optim.offload_pipeline import AdamPipeline
from infinity.optim.sharded_adamw import ShardedAdamW

__all__ = ["OffloadAdamW"]


class OffloadAdamW(ShardedAdamW):
    """``threads``: CPU Adam worker threads; ``lookahead``: shards swapped in ahead of the one updated."""

    def __init__(self, params, source, threads: int, lookahead: int = 2, **hyper):
        super().__init__(params, source, **hyper)
        self.adam = CpuAdamW(threads=threads)
        self.pipeline = AdamPipeline(source.store, self.adam, lookahead=lookahead, tracer=source.tracer)

    def close(self) -> None:
        """Stop the worker threads (CPU Adam's pool, the pipeline's device copier)."""
        self.adam.close()
        self.pipeline.close()

    def _update_shards(self) -> None:
        # the shards stream through the swap-in -> update -> write-back pipeline
        self.source.record_optimizer_stats(self.pipeline.run(self.source.shard_jobs(), self._hyper))
