"""The ``e2`` command: one sub-command per module (apply, overlay, verify, export, status)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from e2 import (
    apply,
    console,
    crash,
    export,
    image,
    models,
    overlay,
    probe,
    rebase,
    status,
    testenv,
    validate,
    verify,
)
from e2.apply import UpstreamOptions
from e2.cache import Cache
from e2.errors import E2Error
from e2.series import Project
from e2.upstream import UpstreamCache

VERBS = (apply, overlay, verify, export, status, rebase, testenv, validate, image, probe,
         models)


@dataclass(frozen=True)
class GlobalOptions:
    """What the options before the verb resolve to; every verb's ``run`` gets it
    beside its own argparse arguments."""

    project: Project
    cache: Cache
    upstream: UpstreamOptions  # where upstream comes from, imported into ``cache``


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="e2", description="vLLM E2: apply, check and build a patch series on pinned vLLM.")
    parser.add_argument("--project", type=Path, metavar="DIR",
                        help="checkout holding series.yaml (default: search upwards from .)")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="the cache directory: upstream sdists and repo, test venvs, CPU "
                             "base, model stores, private Docker daemon, crash log "
                             "(default $XDG_CACHE_HOME/vllm-e2)")
    parser.add_argument("--upstream", type=Path, metavar="PATH", dest="upstream_path",
                        help="use this local tree or sdist tarball as the pinned upstream")
    parser.add_argument("--source", choices=("auto", "sdist", "git"), default="auto",
                        help="where to fetch upstream from (default: sdist, else git)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for verb in VERBS:
        verb.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    cache = Cache.at(args.cache)
    try:
        options = GlobalOptions(Project.find(args.project), cache, UpstreamOptions(
            UpstreamCache(cache), args.source, args.upstream_path))
        return args.run(options, args)
    except E2Error as exc:
        return _report(exc.message, exc.hint, exc.exit_code)
    except KeyboardInterrupt:
        return _report("interrupted", None, 130)
    except OSError as exc:
        # a read-only checkout, a full disk, a file where a folder should be
        return _report(crash.os_error_message(exc),
                       "fix the permissions, space or path named, then run it again", 1)
    except Exception as exc:  # noqa: BLE001 - the one place that turns bugs into a line
        log = crash.write_crash_log(exc, argv, cache.crash_log)
        where = f"details in {log}" if log else "no crash log could be written"
        return _report(f"unexpected {type(exc).__name__}: {exc} ({where})",
                       "please report it with that log", 3)


def _report(message: str, hint: str | None, code: int) -> int:
    console.error(message.splitlines()[0] if code == 3 else message)
    if hint:
        console.err.print(f"hint: {hint}", markup=False, highlight=False)
    return code


if __name__ == "__main__":
    sys.exit(main())
