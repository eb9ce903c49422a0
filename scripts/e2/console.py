"""Terminal output: one rich console on stderr for logs and progress, stdout for results."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


def info(message: str) -> None:
    err.print(escape(message))


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}")


def error(message: str) -> None:
    err.print(f"[red bold]error:[/] {escape(message)}")


def progress(count: bool = False) -> Progress:
    columns = [TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn() if count else DownloadColumn(), TimeElapsedColumn()]
    return Progress(*columns, console=err, transient=True)


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    with err.status(message):
        yield
