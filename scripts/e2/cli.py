"""The ``e2`` command: the global options, then one verb.

Verbs (each in ``commands/<verb>.py``, which holds its parser and its run):
apply, overlay, verify, export, status, rebase and drift (the series and its
upstream), env (the CPU test venv), test seam|upstream (seam tests, upstream's
suites stock vs E2), image render|build|pin|base (the engine image), probe
capacity|serve (what the series changes, measured) and models scan|store (the
offline model store).

This is the one place an argparse Namespace is read: ``main`` turns it into
``GlobalOptions`` and the verb's options dataclass (e2.options), calls the
verb, and turns every error into one line and an exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import sys
from pathlib import Path

import git

from e2 import console, crash
from e2.apply import UpstreamOptions
from e2.cache import Cache
from e2.commands import (
    apply,
    drift,
    env,
    export,
    image,
    models,
    overlay,
    probe,
    rebase,
    status,
    test,
    verify,
)
from e2.errors import E2Error
from e2.fsio import no_space
from e2.gitops import GIT_MISSING, GIT_MISSING_HINT, require_git
from e2.options import GlobalOptions
from e2.series import Project
from e2.upstream import UpstreamCache

# In the order `e2 --help` lists them.
VERBS = (apply, overlay, verify, export, status, rebase, drift, env, test, image, probe, models)


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
    # every verb runs git but those whose parser sets needs_git=False
    parser.set_defaults(needs_git=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for verb in VERBS:
        verb.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    console.tolerate_encoding()
    args = build_parser().parse_args(argv)
    cache = Cache.at(args.cache)
    try:
        if args.needs_git:
            require_git()
        options = GlobalOptions(Project.find(args.project), cache, UpstreamOptions(
            UpstreamCache(cache), args.source, args.upstream_path))
        return args.run(options, verb_options(args))
    except E2Error as exc:
        return _report(exc.message, exc.hint, exc.exit_code)
    except git.GitCommandNotFound:  # git gone from PATH while the verb ran
        return _report(GIT_MISSING, GIT_MISSING_HINT, 1)
    except KeyboardInterrupt:
        return _report("interrupted", None, 130)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:  # one line naming the disk that is full
            return _report(no_space(exc.filename).message, None, 1)
        # a read-only checkout, a file where a folder should be
        return _report(crash.os_error_message(exc),
                       "fix the permissions, space or path named, then run it again", 1)
    except Exception as exc:  # noqa: BLE001 - the one place that turns bugs into a line
        log = crash.write_crash_log(exc, argv, cache.crash_log)
        return _report(crash.crash_line(exc, log), "please report it with that log", 3)


def verb_options(args: argparse.Namespace) -> object:
    """The verb's options dataclass (its parser's ``options`` default), field by
    field from the arguments of the same name; repeated options as tuples."""
    fields = dataclasses.fields(args.options)
    values = {f.name: getattr(args, f.name) for f in fields}
    return args.options(**{name: tuple(value) if isinstance(value, list) else value
                           for name, value in values.items()})


def _report(message: str, hint: str | None, code: int) -> int:
    console.error(message)
    if hint:
        console.err.print(f"hint: {hint}", markup=False, highlight=False)
    return code


if __name__ == "__main__":
    sys.exit(main())
