"""CPU AdamW over flat shards, and the pipeline that runs every shard's update as a job.

- :mod:`~infinity.optim.cpu_adam`: :class:`CpuAdamW`, fp32 AdamW math over chunks on a thread pool.
- :mod:`~infinity.optim.pipeline`: :class:`AdamPipeline` runs :class:`ShardJob` s — in memory, or
  swapped in from the store, updated, written back — reading the next job's states while it
  updates this one.

Kept import-light: import the submodule you need.
"""
