"""How much the ``raot-hf`` command prints on stderr.

* default: one line per stage (library records logged with ``extra={"stage": True}``), our own
  progress bars (one per pass), warnings and errors;
* ``-v``: every INFO record of ``raot_hf`` (``-vv``: DEBUG);
* ``-q``: errors only, no progress bars.

Under ``accelerate launch`` / ``torchrun`` only rank 0 prints stage lines and bars.

transformers' and datasets' own progress bars ("Loading weights", "Generating train split")
and their INFO/WARNING logs are silenced in every mode. Everything set here is undone by the
function :func:`configure` returns, so a command run in-process (tests, notebooks) leaves the
logging and progress-bar state as it found it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

_PLAIN = logging.Formatter("%(message)s")
_NAMED = logging.Formatter("%(levelname)s %(name)s: %(message)s")


class _StageHandler(logging.StreamHandler):
    """Stderr handler of the default mode: stage lines as plain text, warnings and errors with
    their level and source, other INFO records dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        shown = record.levelno >= logging.WARNING or bool(getattr(record, "stage", False))
        return shown and bool(super().filter(record))

    def format(self, record: logging.LogRecord) -> str:
        return (_NAMED if record.levelno >= logging.WARNING else _PLAIN).format(record)


def _handler(verbose: int, quiet: bool) -> logging.Handler:
    # under accelerate launch / torchrun only rank 0 prints stage lines (as only it draws bars)
    secondary = int(os.environ.get("RANK", "0") or 0) != 0
    if verbose and not quiet:
        handler = logging.StreamHandler(sys.stderr)
    elif quiet or secondary:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.ERROR if quiet else logging.WARNING)
    else:
        return _StageHandler(sys.stderr)
    handler.setFormatter(_NAMED)
    return handler


def _silence_libraries(quiet: bool) -> Callable[[], None]:
    """transformers' and datasets' logs and bars off (and ours, through huggingface_hub's
    switch, with ``quiet``); returns what restores them."""
    import datasets
    import transformers
    from huggingface_hub import utils as hub_utils

    tf_logging, ds_logging = transformers.utils.logging, datasets.utils.logging
    tf_verbosity, tf_bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    ds_verbosity, ds_bars_off = ds_logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()
    hub_bars_off = hub_utils.are_progress_bars_disabled()
    tf_logging.set_verbosity_error()
    ds_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()  # also switches huggingface_hub's bars off: ours use them
    datasets.disable_progress_bars()
    if not quiet and not hub_bars_off:
        hub_utils.enable_progress_bars()

    def restore() -> None:
        tf_logging.set_verbosity(tf_verbosity)
        ds_logging.set_verbosity(ds_verbosity)
        tf_logging.enable_progress_bar() if tf_bars else tf_logging.disable_progress_bar()
        datasets.disable_progress_bars() if ds_bars_off else datasets.enable_progress_bars()
        if hub_bars_off != hub_utils.are_progress_bars_disabled():
            hub_utils.disable_progress_bars() if hub_bars_off else hub_utils.enable_progress_bars()

    return restore


def configure(verbose: int, quiet: bool) -> Callable[[], None]:
    """Set up stderr for one command (``verbose``: the count of ``-v``; ``quiet``: ``-q``) and
    return the function that undoes it."""
    package = logging.getLogger("raot_hf")
    level_before = package.level
    # -q keeps warnings flowing to other handlers (e.g. a caller's); only this handler drops them
    package.setLevel(logging.DEBUG if verbose > 1 else logging.WARNING if quiet else logging.INFO)
    handler = _handler(verbose, quiet)
    package.addHandler(handler)
    restore_libraries = _silence_libraries(quiet)

    def restore() -> None:
        package.removeHandler(handler)
        package.setLevel(level_before)
        restore_libraries()

    return restore
