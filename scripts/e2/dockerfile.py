"""The engine image's Dockerfile and build context.

The Dockerfile is rendered from ``images/engine/Dockerfile.j2`` (the
committed ``Dockerfile`` must equal a fresh render: ``e2 verify``); the
context is that Dockerfile and ``overlay.tar``, overlay/vllm laid out under
the base's site-packages and written so that the same series always gives
the same layer diff id.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.series import Project, Series

TEMPLATE = "images/engine/Dockerfile.j2"
DOCKERFILE = "Dockerfile"
OVERLAY_TAR = "overlay.tar"


def pinned_base(series: Series) -> str:
    return f"{series.image.base}@{series.image.digest}" if series.image.digest else series.image.base


def image_version(series: Series, digest: str) -> str:
    return f"{series.upstream.version}-{digest[:12]}"


def _pycache(path: str) -> str:
    """The glob of a module's compiled files, removed along with a deleted module."""
    folder, _, name = path.rpartition("/")
    return f"{folder}/__pycache__/{name.removesuffix('.py')}.*.pyc"


def render_dockerfile(project: Project, series: Series, manifest: dict) -> str:
    # sandboxed: the template reads the names it is given, never Python's internals
    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined,
                                        keep_trailing_newline=True, autoescape=False)
    template_path = project.root / TEMPLATE
    if not template_path.is_file():
        raise E2Error(f"{template_path}: no such file (the Dockerfile template)")
    try:
        tree = env.parse(template_path.read_bytes().decode("utf-8"))
        _refuse_other_templates(tree, template_path)
        return _render(env.from_string(tree), series, manifest)
    except UnicodeDecodeError as exc:
        raise E2Error(f"{template_path}: not UTF-8 text (byte {exc.start})",
                      hint="restore the template: git checkout -- " + TEMPLATE) from None
    except jinja2.TemplateSyntaxError as exc:
        raise E2Error(f"{template_path}:{exc.lineno}: template syntax error: {exc.message}",
                      hint="fix that line of the template") from None
    except jinja2.TemplateError as exc:  # an undefined name, a failed filter
        raise E2Error(f"{template_path}: cannot render: {exc}",
                      hint="the template may use only the names render_dockerfile passes "
                           "(scripts/e2/dockerfile.py)") from None


# the tags that would load another template: the renderer has no loader, and the
# template (with the Dockerfile it renders) must say all the image holds
_LOADING_TAGS = {jinja2.nodes.Include: "include", jinja2.nodes.Import: "import",
                 jinja2.nodes.FromImport: "from", jinja2.nodes.Extends: "extends"}


def _refuse_other_templates(tree: jinja2.nodes.Template, template_path: Path) -> None:
    node = next(tree.find_all(tuple(_LOADING_TAGS)), None)
    if node is not None:
        raise E2Error(f"{template_path}:{node.lineno}: {{% {_LOADING_TAGS[type(node)]} %}} is "
                      "not allowed: the Dockerfile template loads no other template",
                      hint="write what that template holds into " + TEMPLATE)


def _render(template: jinja2.Template, series: Series, manifest: dict) -> str:
    digest = manifest["series_digest"]
    files = manifest["files"]
    text = template.render(
        base=pinned_base(series), base_digest=series.image.digest or "",
        site_packages=series.image.site_packages, version=series.upstream.version,
        tag=series.upstream.tag, digest=digest, digest12=digest[:12],
        image_version=image_version(series, digest), patches=series.patches,
        patch_ids=",".join(p.id for p in series.patches),
        switches=",".join(f"{p.switch.name}={p.switch.default}" for p in series.patches),
        files=files,
        upstream_files=[f for f in files if f["upstream_sha256"]]
        + [d for d in manifest["deleted"] if d["upstream_sha256"]],
        new_files=[f for f in files if not f["upstream_sha256"]],
        deleted=[{**d, "pycache": _pycache(d["path"]), "parent": d["path"].rpartition("/")[0]}
                 for d in manifest["deleted"]],
        compile=[f["path"] for f in files if f["path"].endswith(".py")],
    )
    return text


def has_dockerfile(project: Project) -> bool:
    return (project.root / TEMPLATE).is_file() or (project.root / DOCKERFILE).exists()


def dockerfile_drift(project: Project, series: Series, manifest: dict) -> list[str]:
    """Problems for e2 verify: the committed Dockerfile against a fresh render."""
    path = project.root / DOCKERFILE
    if not (project.root / TEMPLATE).is_file():
        return [f"{DOCKERFILE} exists but {TEMPLATE} is missing"] if path.exists() else []
    if not path.is_file():
        return [f"{DOCKERFILE} is missing (run e2 image render)"]
    if path.read_bytes() != render_dockerfile(project, series, manifest).encode():
        return [f"{DOCKERFILE} differs from what {TEMPLATE} renders (run e2 image render)"]
    return []


# ---------------------------------------------------------------- build context


def reproducible_tar(path: Path, files: dict[str, bytes]) -> None:
    """A tar whose bytes depend on ``files`` only; docker ADD keeps its metadata.

    Sorted entries, every parent dir as its own entry, mtime 0, root-owned,
    fixed modes: docker's COPY would stamp dirs with the build time instead.
    """
    dirs = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(dirs | files.keys()):
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if name in dirs:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(files[name]), 0o644
                tar.addfile(info, io.BytesIO(files[name]))
    write_atomic(path, buffer.getvalue())


def prepare_context(project: Project, series: Series, manifest: dict,
                    site_packages: str) -> Path:
    """.e2/image/: the Dockerfile and overlay.tar, ready for any builder."""
    context = project.state_dir / "image"
    context.mkdir(parents=True, exist_ok=True)
    prefix = site_packages.strip("/")
    files = {f"{prefix}/{f['path']}": (project.overlay_dir / f["path"]).read_bytes()
             for f in manifest["files"]}
    reproducible_tar(context / OVERLAY_TAR, files)
    write_atomic(context / DOCKERFILE, render_dockerfile(project, series, manifest))
    for entry in context.iterdir():  # the context's own mtimes must not matter either
        os.utime(entry, (0, 0))
    return context
