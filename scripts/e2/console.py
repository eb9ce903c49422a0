"""Terminal output: one rich console on stderr for logs and progress, stdout for results."""

from __future__ import annotations

import codecs
import contextlib
import io
import sys
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


def tolerate_encoding() -> None:
    """On a terminal whose encoding lacks a character e2 prints (a title's dash, a
    spinner), write a stand-in instead of failing: the work is done either way."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.encoding and \
                codecs.lookup(stream.encoding).name != "utf-8":
            stream.reconfigure(errors="replace")


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
