"""The last line of defence: an unexpected exception becomes one line and a crash log.

Everything the user can act on is an E2Error; anything else is a bug or an
environment the driver did not foresee. Like pre-commit, the traceback goes
to a log file with the versions and platform a bug report needs, and the
terminal gets one line that points at it.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import traceback
from importlib import metadata
from pathlib import Path


def _version() -> str:
    try:
        return metadata.version("vllm-e2")
    except metadata.PackageNotFoundError:
        return "unknown"


def os_error_message(exc: OSError) -> str:
    """'<file>: <what the OS said>' for the paths an OSError carries."""
    names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
    where = " -> ".join(names) if names else "a file"
    return f"{where}: {exc.strerror or exc}"


def crash_line(exc: BaseException, log: Path | None) -> str:
    """The terminal's one line for an unexpected exception: its type, the first line
    of its text (the rest is in the log) and where the log is."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    where = f"details in {log}" if log else "no crash log could be written"
    return f"unexpected {type(exc).__name__}{': ' + first if first else ''} ({where})"


def write_crash_log(exc: BaseException, argv: list[str], log: Path) -> Path | None:
    """Append the report to ``log`` (the cache's crash log), else to a file of that name
    in the temporary folder; None when even that cannot be written."""
    report = "\n".join([
        f"### {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"e2 version: {_version()}",
        f"python: {sys.version.split()[0]} ({sys.executable})",
        f"platform: {platform.platform()}",
        f"command: e2 {' '.join(argv)}",
        f"cwd: {os.getcwd()}",
        "",
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    ])
    for path in (log, Path(os.environ.get("TMPDIR", "/tmp")) / log.name):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as handle:
                handle.write(report + "\n")
            return path
        except OSError:
            continue
    return None
