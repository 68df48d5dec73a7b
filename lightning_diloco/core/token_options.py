"""The run's shared secret on a command line: one way to give it to every program that needs it
(the synchronizer, the launcher, ``lightning-diloco status``)."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)


def add_token_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--token-file`` (and $DILOCO_TOKEN); ``--token`` too, though it shows in the process list."""
    parser.add_argument("--token-file", help=f"file holding the {what} (default: $DILOCO_TOKEN)")
    parser.add_argument("--token", help="the token itself; visible to every user of this host in the process list, "
                        "prefer --token-file or $DILOCO_TOKEN")


def read_token(path: str | os.PathLike | None, name: str = "--token-file") -> str | None:
    """The token in the file ``path`` (``name``: how the user gave it, for the error), or
    $DILOCO_TOKEN when no file is given."""
    if path is None:
        return os.environ.get("DILOCO_TOKEN") or None
    try:
        token = Path(path).read_text().strip() or None
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ValueError(f"{name} {str(path)!r}: {err.strerror or err}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):  # the run's secret: anyone who reads it acts as every island
        log.warning("%s %r can be read by other users of this host (mode %s): anyone who reads it can act as "
                    "every island; restrict it with `chmod 600 %s`", name, str(path), oct(mode & 0o777), path)
    return token


def resolve_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        return read_token(args.token_file)
    return args.token or read_token(None)
