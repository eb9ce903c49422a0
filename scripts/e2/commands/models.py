"""e2 models scan|store: the hub ids upstream's suites name, and the offline
model store they load from (e2.models keeps the store and the scan)."""

from __future__ import annotations

import argparse

import git

from e2 import console
from e2.fsio import write_atomic
from e2.models import IDS_FILE, IdsFile, missing_models, model_dir, prepare_store, scan
from e2.options import GlobalOptions, ModelsScanOptions, ModelsStoreOptions
from e2.testenv import prepare
from e2.validate import DEFAULT_SUITES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models", help="the offline model store (HF cache layout) upstream's suites load from",
        description="scan: find the hub ids upstream's default suites name and record them "
                    "in hub/ids.yaml; store: write the HF_HUB_CACHE of hub/models/ "
                    "(configs, tokenizers, seeded random weights where asked) and print its path.")
    parser.set_defaults(run=run)
    verbs = parser.add_subparsers(dest="models_command", metavar="VERB", required=True)
    scan_verb = verbs.add_parser("scan", help="rewrite hub/ids.yaml from the pinned release")
    scan_verb.add_argument("--suite", action="append", metavar="PATH",
                           help="scan these suites (default: e2 test upstream's)")
    scan_verb.set_defaults(options=ModelsScanOptions)
    store_verb = verbs.add_parser("store", help="write the store and print its HF_HUB_CACHE")
    store_verb.set_defaults(options=ModelsStoreOptions)


def _scan(options: GlobalOptions, request: ModelsScanOptions) -> int:
    series = options.project.load()
    commit = options.upstream.ensure(series)
    previous = IdsFile.load() if IDS_FILE.is_file() else None
    ids = scan(git.Repo(options.cache.upstream_repo), commit, series.upstream.version,
               list(request.suite or DEFAULT_SUITES), previous)
    write_atomic(IDS_FILE, ids.dump())
    console.info(f"{IDS_FILE}: {len(ids.models)} model ids, {len(ids.not_models)} not models")
    missing = missing_models(ids)
    for model_id in missing:
        console.error(f"{model_id}: no {model_dir(model_id)}/config.json "
                      f"(named at {', '.join(ids.models[model_id][:3])})")
    return 1 if missing else 0


def _store(options: GlobalOptions) -> int:
    project = options.project
    series = project.load()
    env, _ = prepare(project, series, options.cache, "cpu", overlay=False)
    store = prepare_store(series, options.cache, env.python)
    console.out.print(f"HF_HUB_CACHE={store}", markup=False)
    return 0


def run(options: GlobalOptions, models: ModelsScanOptions | ModelsStoreOptions) -> int:
    if isinstance(models, ModelsScanOptions):
        return _scan(options, models)
    return _store(options)
