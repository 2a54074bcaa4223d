"""Optimizers over flat shards (kept import-light: import the submodule you need)."""
