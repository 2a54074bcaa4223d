"""Bad command-line input: :class:`UsageError`, which the program reports as one line on stderr (exit code 2),
and the argument parser that raises it instead of printing its usage block and exiting."""

from __future__ import annotations

import argparse

__all__ = ["UsageError", "Parser"]


class UsageError(Exception):
    """Bad command-line input: reported as one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and calls sys.exit; we want one line and a return code
    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")

