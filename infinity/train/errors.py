"""The two ways ``infinity train`` fails: bad input (nothing started) and a failed rank."""

from __future__ import annotations

__all__ = ["TrainError", "RankError", "StoppedAtOnce"]


class TrainError(ValueError):
    """Bad input to ``train`` (model name, sizes, paths, config): nothing was started."""


class RankError(RuntimeError):
    """A rank failed; ``str()`` is one line naming the rank, ``traceback`` holds its traceback."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.traceback = traceback


class StoppedAtOnce(KeyboardInterrupt):
    """A second stop signal: the run was stopped without finishing its step; ``signum`` is that signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
