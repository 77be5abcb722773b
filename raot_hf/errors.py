"""Errors raised for user mistakes: one line naming the problem and the fix."""


class RaotError(ValueError):
    """A user-facing error: the message names the problem and how to fix it."""


class EquivalenceError(RuntimeError):
    """An exact symmetry transform changed the model's function: a bug, never a warning."""
