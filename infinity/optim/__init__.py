"""CPU AdamW over flat shards, and the pipeline that runs every shard's update as a job.

- :mod:`~infinity.optim.cpu_adam`: :class:`CpuAdamW`, fp32 AdamW math over chunks on a thread pool.
- :mod:`~infinity.optim.pipeline`: :class:`AdamPipeline` runs
  :class:`~infinity.optim.shard_job.ShardJob` s — in memory, or swapped in from the store, updated,
  written back — reading the next job's states while it updates this one.
- :mod:`~infinity.optim.shard_job`: :class:`ShardJob`, one shard's step as the pipeline takes it.
- :mod:`~infinity.optim.shard_update`: a job's AdamW once its tensors are in memory (CpuAdamW on the
  host, the fused kernel on the device; flat or int8-blocked moments).

Kept import-light: import the submodule you need.
"""
