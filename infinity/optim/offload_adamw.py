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

With ``overlap_backward`` the step is turned inside out: the source calls
:meth:`OffloadAdamW.begin_overlapped_step` when backward makes the first shard's
gradient final (the step is counted and the pipeline started there) and submits
each shard's job as its gradient becomes final; ``step()`` waits for the rest.
"""

from __future__ import annotations


from infinity.optim.cpu_adam import CpuAdamW
from infinity.optim.offload_pipeline import AdamPipeline
from infinity.optim.sharded_adamw import ShardedAdamW

__all__ = ["OffloadAdamW"]


class OffloadAdamW(ShardedAdamW):
    """``threads``: CPU Adam worker threads; ``lookahead``: shards swapped in ahead of the one updated;
    ``overlap_backward``: the source submits each shard's job during backward, after calling
    :meth:`begin_overlapped_step`, and :meth:`step` only finishes what backward started."""

    def __init__(self, params, source, threads: int, lookahead: int = 2, overlap_backward: bool = False,
                 **hyper):
        super().__init__(params, source, **hyper)
        self.adam = CpuAdamW(threads=threads)
        self.pipeline = AdamPipeline(source.store, self.adam, lookahead=lookahead, tracer=source.tracer)
        self.overlap_backward = overlap_backward

    def close(self) -> None:
        """Stop the worker threads (a step still running, CPU Adam's pool, the pipeline's device copier)."""
        self.pipeline.close()
        self.adam.close()

    def begin_overlapped_step(self) -> AdamPipeline:
        """The source's first final gradient shard of a step (during backward): count the step, fix its
        hyper-parameters (as they are now: an lr set later applies to the next step) and start the
        pipeline; returns it, for the source to ``submit`` each shard's job."""
        if not self.overlap_backward:
            raise RuntimeError("OffloadAdamW.begin_overlapped_step: built with overlap_backward=False")
        super()._count_step()
        hyper = [self._hyper(i) for i in range(len(self.param_groups))]
        self.pipeline.start(hyper.__getitem__)
        return self.pipeline

    def _count_step(self) -> None:
        if not self.overlap_backward:   # overlapped: counted when backward began updating, not twice
            super()._count_step()

    def _update_shards(self) -> None:
        if not self.overlap_backward:
            # the shards stream through the swap-in -> update -> write-back pipeline
            self.source.record_optimizer_stats(self.pipeline.run(self.source.shard_jobs(), self._hyper))
            return
        # overlapped (fp16 is refused with it, so the step was not skipped): backward started the updates
        if not self.pipeline.running:
            raise RuntimeError("optimizer.step(): optimizer.overlap_backward is on but no update was started "
                               "in the last backward (was the engine connected by infinity.initialize?)")
        self.source.record_optimizer_stats(self.pipeline.finish())
