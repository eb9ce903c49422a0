"""What the command line resolves to: the global options and one frozen
dataclass per verb (or sub-verb).

cli.py builds them from argparse, in one place, by field name: a field here is
the ``dest`` of an argument in commands/<verb>.py, so the two are read side by
side. Nothing below cli.py sees an argparse Namespace; the commands and the
modules they call take these.

Repeated options (``action="append"``) arrive as tuples, never lists, so an
options object stays what it was when the command started.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from e2.apply import UpstreamOptions
from e2.cache import Cache
from e2.series import Project


@dataclass(frozen=True)
class GlobalOptions:
    """The options before the verb; every command gets it beside its own."""

    project: Project
    cache: Cache
    upstream: UpstreamOptions  # where upstream comes from, imported into ``cache``


@dataclass(frozen=True)
class ApplyOptions:
    through: str | None
    out: Path | None
    exact: bool
    force: bool


@dataclass(frozen=True)
class ExportOptions:
    source: Path | None  # --from


@dataclass(frozen=True)
class OverlayOptions:
    pass


@dataclass(frozen=True)
class VerifyOptions:
    pass


@dataclass(frozen=True)
class StatusOptions:
    json: bool


@dataclass(frozen=True)
class RebaseOptions:
    onto: str | None
    resume: bool  # --continue
    skip: bool
    abort: bool
    drop_obsolete: bool
    verdict: str | None
    reason: str | None
    validate: bool
    validate_suite: tuple[str, ...] | None
    dry_run: bool
    report: Path | None
    accept_proposals: bool


@dataclass(frozen=True)
class DriftOptions:
    report: Path | None
    release: tuple[str, ...] | None


@dataclass(frozen=True)
class EnvOptions:
    target: str
    overlay: bool


@dataclass(frozen=True)
class SidesOptions:
    """What both kinds of e2 test take: the env, where results go, the per-test timeout."""

    target: str
    report: Path | None
    timeout: int  # seconds


@dataclass(frozen=True)
class SeamOptions(SidesOptions):
    patch: tuple[str, ...] | None
    jobs: int


@dataclass(frozen=True)
class UpstreamSuitesOptions(SidesOptions):
    suite: tuple[str, ...] | None
    ci: bool
    parallel: bool
    also_switches_off: bool


@dataclass(frozen=True)
class KitOptions:
    dest: Path
    python_version: str | None  # the target's major.minor; None: the test env's
    present: Path | None        # the target's distributions, not to carry
    image: str | None           # run the kit in a container of this image ("": the E2 image)
    gpus: str | None            # docker run --gpus, for that container
    report: Path | None         # where that run's results go


@dataclass(frozen=True)
class ImageRenderOptions:
    pass


@dataclass(frozen=True)
class ImageBuildOptions:
    base: str | None
    tag: str | None
    no_cache: bool
    no_fallback: bool


@dataclass(frozen=True)
class ImagePinOptions:
    pass


@dataclass(frozen=True)
class ImageBaseOptions:
    cpu: bool
    tag: str | None
    workdir: Path | None
    force: bool


@dataclass(frozen=True)
class EngineImageOptions:
    """The probes' --docker engines: the stock and E2 images and their GPUs."""

    docker: bool
    stock_image: str | None
    e2_image: str | None
    gpus: str | None


@dataclass(frozen=True)
class CapacityOptions(EngineImageOptions):
    model: tuple[str, ...]
    zoo: bool
    budget_gib: float
    tp: int
    max_num_seqs: int
    max_model_len: int
    kv_dtype: str
    mamba_cache_mode: str
    capability: str
    lengths: tuple[int, ...]
    python: Path | None
    vllm_path: Path | None
    stock_only: bool
    boot: bool
    results: Path | None
    no_record: bool
    baseline: bool
    json: bool


@dataclass(frozen=True)
class ServeOptions(EngineImageOptions):
    tp: int
    kv_cache_bytes: int
    modes: tuple[str, ...] | None
    report: Path | None
    no_record: bool
    gate_scale: float = 1.0


@dataclass(frozen=True)
class ModelsScanOptions:
    suite: tuple[str, ...] | None


@dataclass(frozen=True)
class ModelsStoreOptions:
    pass
