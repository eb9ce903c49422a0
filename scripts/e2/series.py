"""series.yaml: the data model every command works from.

Loading validates against a strict schema (unknown keys rejected) and reports
YAML errors with file:line:column and schema errors with the key path and the
line it sits on. Dumping is canonical, so ``e2 export`` round-trips the file
byte for byte when nothing changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from filelock import FileLock, Timeout
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from e2.errors import E2Error
from e2.fsio import write_atomic

SERIES_FILE = "series.yaml"
PATCHES_DIR = "patches"
SWITCH_PREFIX = "VLLM_E2_"

_SWITCH_NAME = re.compile(r"^VLLM_E2_[A-Z0-9_]+$")
_PATCH_ID = re.compile(r"^[0-9]{4}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
RELEASE_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)+([a-z0-9.+-]*)$")

HEADER = """\
# vLLM E2 patch series: the pinned upstream, the engine image base and the
# ordered patches. Written by `e2 export` and `e2 rebase`; edit the metadata
# freely, the layout is kept canonical. Schema: scripts/e2/series.py.
"""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)


class GitSource(_Strict):
    remote: str
    commit: str | None = None

    @field_validator("commit")
    @classmethod
    def _full_sha(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9a-f]{40}", value):
            raise ValueError("must be a full 40-hex commit id or null")
        return value


class Upstream(_Strict):
    project: Literal["vllm"] = "vllm"
    version: str
    tag: str
    sdist_sha256: str
    git: GitSource | None = None

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if not RELEASE_VERSION.match(value):
            raise ValueError(f"{value!r} is not a release version like 0.31.0")
        return value

    @field_validator("tag")
    @classmethod
    def _tag_names_version(cls, value: str, info: ValidationInfo) -> str:
        # the image is labelled with the version and built from the tag: they must agree
        version = info.data.get("version")
        if version is not None and value != f"v{version}":
            raise ValueError(f"{value!r} disagrees with version {version!r} (its tag is "
                             f"'v{version}')")
        return value

    @field_validator("sdist_sha256")
    @classmethod
    def _sha(cls, value: str) -> str:
        if not _SHA256.match(value):
            raise ValueError("must be 64 lowercase hex digits")
        return value


class ImagePin(_Strict):
    base: str
    digest: str | None = None
    site_packages: str

    @field_validator("digest")
    @classmethod
    def _digest(cls, value: str | None) -> str | None:
        if value is not None and not _DIGEST.match(value):
            raise ValueError("must be sha256:<64 hex> or null (unpinned)")
        return value

    @field_validator("site_packages")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path inside the image")
        return value.rstrip("/")


class Switch(_Strict):
    name: str
    default: Literal["0", "1"]
    compiled: bool = False
    doc: str

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _SWITCH_NAME.match(value):
            raise ValueError(f"{value!r} must look like VLLM_E2_NAME (capitals, digits, _)")
        return value


class Patch(_Strict):
    id: str
    file: str
    title: str
    switch: Switch
    upstream: list[str] = Field(default_factory=list)
    drop_when: str
    tests: list[str] = Field(min_length=1)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not _PATCH_ID.match(value):
            raise ValueError("must be four digits in quotes, like '0001'")
        return value

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        if "/" in value or not value.endswith(".patch"):
            raise ValueError("must be a file name under patches/ ending in .patch")
        return value


class Series(_Strict):
    upstream: Upstream
    image: ImagePin
    patches: list[Patch] = Field(default_factory=list)

    @field_validator("patches")
    @classmethod
    def _one_file_each(cls, patches: list[Patch]) -> list[Patch]:
        # two entries on one file would apply it twice and name it twice in the image
        first: dict[str, Patch] = {}
        for index, patch in enumerate(patches):
            earlier = first.setdefault(patch.file, patch)
            if earlier is not patch:
                twice = ("twice, both times as {first}" if earlier.id == patch.id
                         else "under two ids, {first} and {second}")
                raise PydanticCustomError(
                    "duplicate_file", "{file} is listed " + twice + " (each patch has a file "
                    "of its own)", {"file": patch.file, "first": earlier.id, "second": patch.id,
                                    "at": ("patches", index, "file")})
        return patches

    def by_id(self, patch_id: str) -> Patch:
        for patch in self.patches:
            if patch.id == patch_id:
                return patch
        raise E2Error(f"series.yaml has no patch {patch_id}",
                      hint="ids: " + ", ".join(p.id for p in self.patches))


@contextlib.contextmanager
def _held_alone(lock_file: Path, busy: str, hint: str) -> Iterator[None]:
    """Hold ``lock_file`` for the block; when another process holds it, refuse at
    once with ``busy`` rather than wait."""
    lock = FileLock(str(lock_file), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise E2Error(busy, hint=hint) from None
    try:
        yield
    finally:
        lock.release()


@dataclass(frozen=True)
class Project:
    """Where a series lives on disk, and the paths derived from it."""

    root: Path

    @property
    def series_file(self) -> Path:
        return self.root / SERIES_FILE

    @property
    def patches_dir(self) -> Path:
        return self.root / PATCHES_DIR

    @property
    def overlay_dir(self) -> Path:
        return self.root / "overlay"

    @property
    def state_dir(self) -> Path:
        """Scratch and state that never gets committed (.gitignore'd)."""
        return self.root / ".e2"

    @property
    def default_worktree(self) -> Path:
        return self.state_dir / "work"

    def patch_path(self, patch: Patch) -> Path:
        return self.patches_dir / patch.file

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Held by every command that rewrites the checkout or its worktree
        (apply, export, overlay, rebase): one at a time, the second is refused."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with _held_alone(self.state_dir / "lock",
                         "another e2 command (apply, export, overlay or rebase) is changing "
                         f"this checkout ({self.root})",
                         "wait for it to finish, then run this again"):
            yield

    @contextlib.contextmanager
    def test_logs(self, kind: str) -> Iterator[Path]:
        """``.e2/logs/<kind>`` (seam, upstream): pytest's logs and JUnit files, held
        by one ``e2 test`` run at a time, since a second would rewrite the files the
        first still reads."""
        logs = self.state_dir / "logs" / kind
        logs.parent.mkdir(parents=True, exist_ok=True)
        lock = logs.with_suffix(".lock")
        with _held_alone(lock, f"another `e2 test {kind}` is running in this checkout "
                               f"(it holds {lock})",
                         "wait for it to end, or run from another checkout"):
            yield logs

    def load(self) -> Series:
        return load_series(self.series_file)

    @classmethod
    def find(cls, start: Path | None = None) -> Project:
        here = (start or Path.cwd()).resolve()
        for candidate in [here, *here.parents]:
            if (candidate / SERIES_FILE).is_file():
                return cls(candidate)
        raise E2Error(f"no {SERIES_FILE} in {here} or any parent",
                      hint="run e2 inside a vLLM E2 checkout, or pass --project DIR")


# ---------------------------------------------------------------- loading


class _Refused(yaml.composer.ComposerError):
    """An anchor or alias: valid YAML that series.yaml may not hold."""


class _PlainLoader(yaml.SafeLoader):
    """The safe loader, refusing an anchor or alias before composing it: series.yaml is
    plain data, and an alias bomb (a billion laughs) is never expanded."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise _Refused(problem=f"YAML {kind}{anchor}: series.yaml may not use anchors "
                                   "or aliases (write each value out)",
                           problem_mark=event.start_mark)
        return super().compose_node(parent, index)


def _compose_with_marks(text: str, path: Path) -> tuple[Any, dict[tuple, tuple[int, int]]]:
    """Parse YAML into plain data plus a map from key path to (line, column)."""
    try:
        root = yaml.compose(text, Loader=_PlainLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        if isinstance(exc, _Refused):
            raise E2Error(f"{where}: {problem}", hint="series.yaml holds plain data only: "
                          "write the value out where the alias stands") from None
        raise E2Error(f"{where}: invalid YAML: {problem}") from None
    marks: dict[tuple, tuple[int, int]] = {}
    constructor = yaml.SafeLoader("")

    def walk(node: yaml.Node, key_path: tuple) -> Any:
        marks.setdefault(key_path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            result = {}
            for key_node, value_node in node.value:
                key = constructor.construct_object(key_node, deep=True)
                if key in result:
                    line = key_node.start_mark.line + 1
                    raise E2Error(f"{path}:{line}: duplicate key {key!r}")
                child_path = key_path + (key,)
                marks[child_path] = (key_node.start_mark.line + 1,
                                     key_node.start_mark.column + 1)
                result[key] = walk(value_node, child_path)
            return result
        if isinstance(node, yaml.SequenceNode):
            return [walk(item, (*key_path, i)) for i, item in enumerate(node.value)]
        return constructor.construct_object(node, deep=True)

    try:
        return (walk(root, ()) if root is not None else None), marks
    except yaml.YAMLError as exc:  # a tag the safe loader refuses (!!python/object ...)
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise E2Error(f"{where}: invalid YAML: {problem}",
                      hint="series.yaml holds plain data only: no YAML tags") from None


def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def parse_series(text: str, path: Path) -> Series:
    data, marks = _compose_with_marks(text, path)
    if not isinstance(data, dict):
        raise E2Error(f"{path}:1:1: expected a mapping with upstream, image and patches")
    try:
        return Series.model_validate(data)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            loc = tuple(error.get("ctx", {}).get("at", error["loc"]))
            # pydantic appends union/literal tags to loc; trim to what exists in the file
            known = loc
            while known and known not in marks:
                known = known[:-1]
            line, column = marks.get(known, (1, 1))
            message = error["msg"]
            if error["type"] == "extra_forbidden":
                message = "unknown key"
            lines.append(f"{path}:{line}:{column}: {_format_loc(loc)}: {message}")
        raise E2Error("\n".join(lines)) from None


def load_series(path: Path) -> Series:
    if not path.is_file():
        raise E2Error(f"{path}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise E2Error(f"{path}:{line}: not UTF-8 text (byte {exc.start})",
                      hint="save series.yaml as UTF-8") from None
    return parse_series(text, path)


# ---------------------------------------------------------------- dumping


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # a value met twice is written out twice: the loader refuses aliases


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def dump_series(series: Series | dict) -> str:
    """Canonical YAML; a dict may hold the nulls of a new patch awaiting its metadata."""
    data = series.model_dump(mode="json") if isinstance(series, Series) else series
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True,
                     default_flow_style=False, width=88, indent=2)
    return HEADER + body


def save_series(series: Series, path: Path) -> None:
    write_atomic(path, dump_series(series))


def write_image_digest(path: Path, digest: str) -> None:
    """Set image.digest in series.yaml; every other byte of the file stays as it is."""
    if not _DIGEST.match(digest):
        raise E2Error(f"{digest!r} is not a digest (sha256:<64 hex>)")
    text = path.read_text(encoding="utf-8")
    series = parse_series(text, path)
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    assert root is not None  # parse_series accepted the text: it holds a document
    image = next(value for key, value in root.value if key.value == "image")
    node = next((value for key, value in image.value if key.value == "digest"), None)
    if node is None:  # no digest key yet: canonical layout puts it after base
        save_series(series.model_copy(update={
            "image": series.image.model_copy(update={"digest": digest})}), path)
        return
    new = text[:node.start_mark.index] + digest + text[node.end_mark.index:]
    parse_series(new, path)
    write_atomic(path, new)


# ---------------------------------------------------------------- identity


def series_digest(series: Series, patches_dir: Path) -> str:
    """A digest over what the image is built from: the pin and every patch's bytes."""
    entries = []
    for patch in series.patches:
        patch_file = patches_dir / patch.file
        if not patch_file.is_file():
            raise E2Error(f"{patch_file}: listed in series.yaml as {patch.id} but missing",
                          hint="restore the file, or remove the entry from series.yaml")
        entries.append({
            "id": patch.id,
            "sha256": hashlib.sha256(patch_file.read_bytes()).hexdigest(),
            "switch": patch.switch.model_dump(mode="json"),
        })
    canonical = json.dumps({
        "upstream": {"version": series.upstream.version, "tag": series.upstream.tag,
                     "sdist_sha256": series.upstream.sdist_sha256},
        "patches": entries,
    }, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def slugify(title: str, limit: int = 52) -> str:
    """The file-name slug git format-patch would derive from a subject."""
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    if len(slug) > limit:
        cut = slug[:limit + 1]
        slug = cut[:cut.rfind("-")] if "-" in cut else slug[:limit]
    return slug or "patch"
