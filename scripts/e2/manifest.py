"""overlay/MANIFEST.json: what the overlay holds and the upstream files it was made from.

Written by ``e2 overlay``; read by status, verify, the image build and the
test env, each through ``load`` so a file of the wrong shape is refused with
its path and the key that is wrong, never half-read.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from e2.errors import E2Error

FORMAT = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ManifestUpstream(_Strict):
    project: str
    version: str
    tag: str
    sdist_sha256: str


class ManifestFile(_Strict):
    path: str
    sha256: str
    upstream_sha256: str | None
    patches: list[str]
    generated: bool


class ManifestDeletion(_Strict):
    path: str
    upstream_sha256: str
    patches: list[str]


class Manifest(_Strict):
    format: int
    upstream: ManifestUpstream
    series_digest: str
    patches: list[str]
    files: list[ManifestFile]
    deleted: list[ManifestDeletion]


def load(path: Path) -> dict | None:
    """The manifest as plain data once it matches the schema; None when there is none."""
    if not path.is_file():
        return None
    hint = "regenerate it with: e2 overlay"
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise E2Error(f"{path}: not UTF-8 text (byte {exc.start})", hint=hint) from None
    except json.JSONDecodeError as exc:
        raise E2Error(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}",
                      hint=hint) from None
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise E2Error(f"{path}: {where}: {first['msg']}", hint=hint) from None
    if manifest.format != FORMAT:
        raise E2Error(f"{path}: format {manifest.format}, this e2 reads format {FORMAT}",
                      hint=hint)
    return manifest.model_dump(mode="json")
