"""Small pieces the commands share: sizes in words, confirmation prompts, progress bars on stderr."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigurationError

__all__ = ["UsageError", "confirm", "human", "plain", "progress", "require_local", "shown"]


class UsageError(ConfigurationError):
    """Flags that do not go together, found after parsing: exit code 2, as argparse gives bad arguments."""


# Control characters (C0, DEL, C1) and the bidirectional overrides as \xNN / \uNNNN: words from a
# hostile checkpoint must not move the cursor, clear the screen, retitle the terminal, forge a line
# of output or read backwards (found by outside attacks).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS.update({c: f"\\u{c:04x}" for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def plain(text: object) -> str:
    """``text`` with every control character written out, for a terminal or a log line."""
    return str(text).translate(_CONTROLS)


def shown(text: object) -> Any:
    """``text`` (a path, a name, a checkpoint's words) as a Rich ``Text``: printed as it is, never
    read as markup or emoji codes, control characters written out (:func:`plain`)."""
    from rich.text import Text

    return Text(plain(text))


def human(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def confirm(question: str, yes: bool) -> bool:
    """Ask on the terminal; ``--yes`` answers for the user. Without a terminal, refuse to guess."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise ConfigurationError(f"{question} -- no terminal to ask on; pass --yes to confirm")
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


@contextlib.contextmanager
def progress(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A byte-counting progress bar on stderr, only when stderr is a terminal; yields ``advance(n)``."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def require_local(path: str, want_folder: bool = True) -> None:
    """ConfigurationError (one line, exit 1) when a local ``path`` is missing, not a folder or unreadable.

    URLs pass: object-store prefixes are not folders, and an empty listing is an answer.
    """
    from .ls import local_problem

    problem = local_problem(path, want_folder)
    if problem is not None:
        raise ConfigurationError(problem)
