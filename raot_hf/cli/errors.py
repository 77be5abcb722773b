"""How every ``raot-hf`` command reports a user's mistake: one line on stderr, exit code 2."""

from __future__ import annotations

import functools
import sys

import click

from raot_hf.errors import EquivalenceError, RaotError


def friendly_errors(fn):
    """Turn user errors into one line on stderr and exit code 2 (tracebacks only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = kwargs.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except (RaotError, EquivalenceError) as exc:
            if debug:
                raise
            click.echo(f"Error: {exc}", err=True)
            sys.exit(2)
        except OSError as exc:  # disk full, permissions, network: the environment, not a bug
            if debug:
                raise
            reason = " ".join(str(exc).split()) or type(exc).__name__
            click.echo(f"Error: {reason} (rerun with --debug for the traceback)", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("Interrupted: no output was written.", err=True)
            sys.exit(130)

    return wrapper
