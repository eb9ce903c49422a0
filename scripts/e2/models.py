"""The offline model store that upstream's suites load their models from (e2
models scan|store, commands/models.py; e2 test writes it too).

Upstream's tests build ``ModelConfig``s for hub ids (``facebook/opt-125m``,
``Qwen/Qwen3-0.6B``, ``llava-hf/llava-1.5-7b-hf``, ...). No hub is reachable
from the test machines, so each id gets a snapshot in the Hugging Face cache
layout (``HF_HUB_CACHE``: ``models--org--name/refs/main`` naming
``snapshots/<commit>/``) holding what the tests read: ``config.json`` with
the model's published dimensions, and the generation, processor and
tokenizer files where a test needs them, and seeded random weights at the
published shapes where a test loads or runs the model (``weights.yaml``).
vLLM's own loading code then runs unchanged with ``HF_HUB_OFFLINE=1``.

* ``scan``: finds the ids in the suites' sources (every string literal shaped
  like a repo id, plus the model ``ModelConfig`` defaults to) and records each
  with the ``file:line`` it came from in ``hub/ids.yaml``. Strings that have
  the shape but name no model are kept there by hand, with the reason.
* ``store``: writes the store from ``hub/models/<org>/<name>/``; tokenizers
  are made by ``hub/make_tokenizer.py`` and weights by ``hub/make_weights.py``
  under the test env's python (it has ``tokenizers``, ``transformers`` and
  ``torch``; the driver does not). The store is
  keyed by the digest of its inputs, so both sides and later runs share it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import git
import yaml

from e2 import console
from e2.cache import Cache
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.series import Series

HUB = Path(__file__).resolve().parent / "hub"
IDS_FILE = HUB / "ids.yaml"
MODELS = HUB / "models"
TOKENIZER_SPEC = "tokenizer.yaml"          # in a model's folder: how to make its tokenizer
TOKENIZER_MAKER = HUB / "make_tokenizer.py"
WEIGHTS_SPEC = "weights.yaml"              # in a model's folder: seeded random weights to write
WEIGHTS_MAKER = HUB / "make_weights.py"
SPECS = (TOKENIZER_SPEC, WEIGHTS_SPEC)     # made into files, not copied
STORE_FORMAT = 1
DONE = "e2-store.json"                     # written last: marks a complete store
KEEP_STORES = 4
# org/name as the hub allows them; a repo id never ends in a source-file extension
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
NOT_A_REPO_SUFFIX = re.compile(r"\.(py|json|txt|yaml|yml|jinja|png|jpg|jpeg|wav|mp4|so)$")
# ModelConfig's default model: tests that build ModelConfig() or VllmConfig() load it
MODEL_CONFIG_FILE = "vllm/config/model.py"


# ---------------------------------------------------------------- scan


def _id_strings(source: str, path: str) -> list[tuple[str, int]]:
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise E2Error(f"{path}:{exc.lineno}: cannot parse: {exc.msg}") from None
    return [(node.value, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and REPO_ID.match(node.value) and not NOT_A_REPO_SUFFIX.search(node.value)]


def _model_config_default(source: str) -> tuple[str, int] | None:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "ModelConfig":
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and item.target.id == "model" and isinstance(item.value, ast.Constant)
                        and isinstance(item.value.value, str)):
                    return item.value.value, item.lineno
    return None


def scan_sources(files: dict[str, str]) -> dict[str, list[str]]:
    """Repo-id-shaped strings in ``files`` (path -> source): id -> sorted ``path:line``."""
    found: dict[str, set[tuple[str, int]]] = {}
    for path, source in files.items():
        hits = _id_strings(source, path) if path != MODEL_CONFIG_FILE else []
        if path == MODEL_CONFIG_FILE:
            default = _model_config_default(source)
            if default is None:
                raise E2Error(f"{path}: no `model: str = \"...\"` default in class ModelConfig",
                              hint="upstream moved ModelConfig's default model; update the scan")
            hits = [default]
        for value, line in hits:
            found.setdefault(value, set()).add((path, line))
    return {value: [f"{p}:{n}" for p, n in sorted(places)]
            for value, places in sorted(found.items())}


def suite_files(repo: git.Repo, commit: str, suites: list[str]) -> dict[str, str]:
    """The Python sources of ``suites`` (files, folders or node ids) at ``commit``."""
    paths = sorted({suite.split("::", 1)[0] for suite in suites})
    listed = repo.git.ls_tree("-r", "--name-only", commit, "--", *paths).splitlines()
    missing = [p for p in paths if not any(f == p or f.startswith(p.rstrip("/") + "/")
                                           for f in listed)]
    if missing:
        raise E2Error("no such suite in the upstream release: " + ", ".join(missing))
    wanted = [f for f in listed if f.endswith(".py")] + [MODEL_CONFIG_FILE]
    return {path: repo.git.show(f"{commit}:{path}") for path in wanted}


@dataclass
class IdsFile:
    """hub/ids.yaml: what the scan found, and the id-shaped strings that name no model."""

    upstream: str
    suites: list[str]
    models: dict[str, list[str]]        # id -> where it came from (path:line)
    not_models: dict[str, str]          # id-shaped string -> why it is not a model

    @classmethod
    def load(cls, path: Path = IDS_FILE) -> IdsFile:
        try:
            data = yaml.safe_load(path.read_text())
            return cls(str(data["upstream"]), list(data["suites"]), dict(data["models"]),
                       dict(data.get("not_models") or {}))
        except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
            raise E2Error(f"{path}: not a readable ids file ({exc})",
                          hint="regenerate it: e2 models scan") from None

    def dump(self) -> str:
        header = ("# Hub ids named by upstream's default suites, found by `e2 models scan`\n"
                  "# (string literals shaped like a repo id, and ModelConfig's default\n"
                  "# model), each with the file:line it came from. `models` is rewritten\n"
                  "# by the scan; `not_models` is kept by hand: id-shaped strings that\n"
                  "# name no model, with the reason. Every model needs a folder in\n"
                  "# hub/models/<org>/<name>/.\n")
        body = {"upstream": self.upstream, "suites": self.suites, "models": self.models,
                "not_models": self.not_models}
        return header + yaml.safe_dump(body, sort_keys=False, width=100)


def scan(repo: git.Repo, commit: str, version: str, suites: list[str],
         previous: IdsFile | None) -> IdsFile:
    found = scan_sources(suite_files(repo, commit, suites))
    kept = previous.not_models if previous else {}
    return IdsFile(version, list(suites),
                   {i: s for i, s in found.items() if i not in kept},
                   {i: why for i, why in kept.items() if i in found})


# ---------------------------------------------------------------- the store


def model_dir(model_id: str) -> Path:
    return MODELS / model_id


def missing_models(ids: IdsFile) -> list[str]:
    return [i for i in ids.models if not (model_dir(i) / "config.json").is_file()]


def _inputs() -> dict[str, bytes]:
    """Every file the store is made from (model folders and the tokenizer maker)."""
    files = {str(p.relative_to(MODELS)): p.read_bytes()
             for p in sorted(MODELS.rglob("*")) if p.is_file()}
    files["<maker>"] = TOKENIZER_MAKER.read_bytes()
    files["<weights maker>"] = WEIGHTS_MAKER.read_bytes()
    return files


def store_key(inputs: dict[str, bytes]) -> str:
    digest = hashlib.sha256(f"format {STORE_FORMAT}\n".encode())
    for name, data in sorted(inputs.items()):
        digest.update(f"{name}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return digest.hexdigest()[:16]


def snapshot_commit(files: dict[str, bytes]) -> str:
    """A stable 40-hex revision for a snapshot: the hash of its files."""
    digest = hashlib.sha1()
    for name, data in sorted(files.items()):
        digest.update(f"{name}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return digest.hexdigest()


def _check_model(folder: Path, model_id: str) -> None:
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise E2Error(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
        if path.name == "config.json" and not (isinstance(data, dict) and (
                data.get("architectures") or data.get("model_type"))):
            raise E2Error(f"{path}: {model_id} has neither `architectures` nor `model_type`")


def build_store(cache: Cache, python: Path) -> Path:
    """The HF_HUB_CACHE for every model under hub/models (made once per content)."""
    inputs = _inputs()
    store = cache.hub_stores / store_key(inputs)
    if (store / DONE).is_file():
        return store
    store.parent.mkdir(parents=True, exist_ok=True)
    with Cache.lock(store):
        if (store / DONE).is_file():
            return store
        staging = store.with_name(store.name + ".new")
        shutil.rmtree(staging, ignore_errors=True)
        models = sorted(str(p.parent.relative_to(MODELS)) for p in MODELS.glob("*/*/config.json"))
        for model_id in models:
            _write_snapshot(staging, model_id, python)
        write_atomic(staging / DONE, json.dumps({"format": STORE_FORMAT, "models": models},
                                                indent=2) + "\n")
        shutil.rmtree(store, ignore_errors=True)
        staging.rename(store)
    _prune(store.parent, keep=store)
    return store


def _write_snapshot(store: Path, model_id: str, python: Path) -> None:
    folder = model_dir(model_id)
    _check_model(folder, model_id)
    with_files = store / ("models--" + model_id.replace("/", "--"))
    scratch = with_files / "scratch"
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())
             if p.is_file() and p.name not in SPECS}
    if (folder / TOKENIZER_SPEC).is_file():
        files.update(_make(TOKENIZER_MAKER, [folder / TOKENIZER_SPEC], scratch, python,
                           f"the tokenizer of {model_id}"))
    if (folder / WEIGHTS_SPEC).is_file():
        files.update(_make(WEIGHTS_MAKER, [folder / WEIGHTS_SPEC, folder], scratch, python,
                           f"the weights of {model_id}"))
    commit = snapshot_commit(files)
    for name, data in files.items():
        target = with_files / "snapshots" / commit / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    write_atomic(with_files / "refs" / "main", commit)


def _make(maker: Path, inputs: list[Path], out: Path, python: Path,
          what: str) -> dict[str, bytes]:
    """Run a hub/make_*.py maker under the test env's python; the files it wrote."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    result = subprocess.run([str(python), "-P", str(maker), *map(str, inputs), str(out)],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise E2Error(f"{inputs[0]}: making {what} failed:\n" + result.stderr.strip()[-2000:])
    made = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
    shutil.rmtree(out)
    return made


def _prune(stores: Path, keep: Path) -> None:
    done = sorted((p for p in stores.iterdir() if (p / DONE).is_file()),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    for old in done[KEEP_STORES:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def prepare_store(series: Series, cache: Cache, python: Path) -> Path:
    """The store for a run. A stale or incomplete ids file only warns: the tests that
    miss a model then fail as hub-data on both sides, each named in the report."""
    ids = IdsFile.load()
    if ids.upstream != series.upstream.version:
        console.warn(f"{IDS_FILE}: scanned from vLLM {ids.upstream}, the series pins "
                     f"{series.upstream.version}; rescan: e2 models scan")
    missing = missing_models(ids)
    if missing:
        console.warn(f"{IDS_FILE}: no model folder for {', '.join(missing)} "
                     f"(write its config.json under {MODELS}/<org>/<name>/)")
    with console.status("writing the offline model store"):
        return build_store(cache, python)
