"""Failures a restart cannot fix, found before the run starts or in a crashed island's output.

Without these the launcher restarts an island whose command cannot even start ``--max-restarts``
times, printing each time that it "trains its whole step count again", before saying nothing
useful.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence

# a traceback's last line: the exception's (qualified) name, then its message
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b")

PACKAGE = "lightning_diloco"
_FINDS_PACKAGE = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({PACKAGE!r}) is None)"


def check_command(command: Sequence[str], env: dict[str, str], timeout: float = 120.0) -> None:
    """Raise ValueError, naming the fix, when ``command`` cannot be run or (a Python command)
    its interpreter cannot import this package or its script is not there."""
    program = command[0]
    path = program if os.sep in program else shutil.which(program, path=env.get("PATH"))
    if path is None or not os.access(path, os.X_OK):
        raise ValueError(f"cannot run the island command {program!r}: not found or not executable; "
                         f"give its full path (this launcher's Python is {sys.executable})")
    if not os.path.basename(program).startswith("python"):
        return
    try:  # find_spec only locates the package: no torch import, a fraction of a second
        found = subprocess.run([path, "-c", _FINDS_PACKAGE], env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        found = None  # a very loaded host: the islands will say it themselves
    if found is not None and found.returncode != 0:
        raise ValueError(
            f"the island command's Python ({path}) cannot import {PACKAGE}: every island would crash at start. "
            f"Install it there ({path} -m pip install lightning-diloco) or run the command with the Python that "
            f"has it: lightning-diloco run ... -- {sys.executable} {' '.join(command[1:])}")
    script = _script(command[1:])
    if script is not None and not os.path.isfile(script):
        raise ValueError(f"the island script {script!r} does not exist in {os.getcwd()}, the folder the islands start "
                         "in: run lightning-diloco from the folder the path is relative to, or give its full path")


def _script(arguments: Sequence[str]) -> str | None:
    """The script a ``python [options] SCRIPT ...`` command runs; None for ``-m``, ``-c`` or none."""
    takes_value = {"-W", "-X", "--check-hash-based-pycs"}
    skip = False
    for arg in arguments:
        if skip:
            skip = False
        elif arg in ("-m", "-c", "-") or arg.startswith(("-m", "-c")) and not arg.startswith("--"):
            return None
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def import_failure(lines: Iterable[str]) -> str | None:
    """The line of a crashed island's output that says a module is missing, if one does."""
    for line in reversed(list(lines)):
        if line.lstrip().startswith(("ModuleNotFoundError:", "ImportError:")):
            return line.strip()
    return None


def exception_line(lines: Iterable[str]) -> str | None:
    """The last line of a crashed process's output that names an exception (its traceback's
    end, ``ValueError: ...``), if one does: what its failure was, to compare with the next one."""
    for line in reversed(list(lines)):
        text = line.strip()
        if _EXCEPTION.match(text):
            return text
    return None
