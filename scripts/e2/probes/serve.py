"""e2 probe serve: stock vs E2 engines serving the same tiny hybrid model, token for token.

A tiny random-weight Qwen3-Next-shaped model (3 Gated DeltaNet layers, 1 full
attention layer; ``tiny_model.py``) is written once, seeded, so both sides
serve the same weights. Each side runs ``vllm serve``'s API server on
127.0.0.1 only, prompts go in as token ids (``--skip-tokenizer-init``) to
/v1/completions, greedy, fixed ``max_tokens``, ``ignore_eos``.

The cases come from what the engine itself reports (its block size and KV
capacity, read from /metrics' ``vllm:cache_config_info`` and its log line
``KV cache size: N tokens``): prompts of block-1, block and block+1 tokens; two
requests sharing a long prefix (a prefix-cache hit, ``vllm:prefix_cache_hits``);
more concurrent requests than the KV pool holds (preemption and resume,
``vllm:num_preemptions``). Every case runs with sync scheduling and with
``--async-scheduling``; the resolved config (/server_info, dev mode) says
whether async scheduling is really on: vLLM's CPU platform turns it off, and
those cases are then reported as not run rather than passed.

Local: stock is the e2 env's venv python, E2 the same python with the e2
view first on PYTHONPATH. ``--docker``: the stock and E2 images through the
Docker SDK (DOCKER_HOST, ssh:// included); the model is written into a
Docker volume by the stock image, the engine runs with no network and the
probe talks to it with ``docker exec`` of the same stdlib client, so a remote
host needs nothing but its Docker daemon.

Output token ids are compared request by request; any mismatch, incomplete
request or case that did not exercise its path exits non-zero. Records: JSON
and Markdown (``serve-cpu`` or ``serve-docker``/``serve-gpu``) under
docs/validation/.

This module runs the probe (its parser is commands/probe.py); the parts are ``serve_client`` (the stdlib HTTP
client), ``serve_model`` (the tiny model), ``engines`` (local and Docker
engines), ``serve_metrics`` (what an engine reports), ``serve_cases`` (the
cases and a side's run), ``serve_compare`` (the verdict) and ``serve_report``
(the record).
"""

from __future__ import annotations

import time
from pathlib import Path

from e2.cache import Cache
from e2.dockerhost import connect
from e2.errors import E2Error
from e2.image import engine_images
from e2.options import GlobalOptions, ServeOptions
from e2.probes.engines import DockerRunner, LocalRunner, Runner
from e2.probes.serve_cases import run_side
from e2.probes.serve_gate import GATE_MODEL, GATE_MODES, gate_settings
from e2.probes.serve_model import ensure_model
from e2.probes.serve_report import conclude, header
from e2.probes.serve_settings import ALL_MODES, FORMAT, GEOMETRY, MODES, SIDES, TP_SIZES
from e2.series import Project, Series
from e2.testenv import prepare


def run_serve(options: GlobalOptions, probe: ServeOptions) -> int:
    project = options.project
    series = project.load()
    started = time.monotonic()
    if probe.tp not in TP_SIZES:
        raise E2Error(f"--tp {probe.tp}: the tiny model's heads split over "
                      + ", ".join(map(str, TP_SIZES)) + " GPUs only")
    if not probe.docker and (probe.stock_image or probe.e2_image or probe.gpus):
        raise E2Error("--stock-image, --e2-image and --gpus go with --docker")
    logs = project.state_dir / "logs" / "serve"
    modes = tuple(m for m in ALL_MODES if m in (probe.modes or MODES))
    geometries = {GEOMETRY[mode] for mode in modes if mode in GEOMETRY}
    gate = any(mode in GATE_MODES for mode in modes)
    if not 0 < probe.gate_scale <= 1:
        raise E2Error(f"--gate-scale {probe.gate_scale}: a factor above 0, at most 1")
    if gate and probe.gate_scale != 1.0 and probe.docker:
        raise E2Error("--gate-scale is for a shorter run on the CPU: the GPU gate runs in full")
    runner: Runner
    if probe.docker:
        runner, model, name = _docker_runner(probe, project, series, logs, geometries)
    else:
        runner, model, name = _local_runner(probe, options.cache, project, series, logs,
                                            geometries)
    plans: dict[str, dict] = {}
    sides = {side: run_side(runner, side, plans, modes, probe.gate_scale) for side in SIDES}
    record: dict = {"format": FORMAT, "sides": sides,
                    "header": header(project, series, runner, model,
                                     sides["stock"].get("device"), modes,
                                     time.monotonic() - started)}
    if gate:
        record["header"]["settings"]["gate"] = gate_settings(probe.gate_scale)
        record["header"]["model"] += f"; {GATE_MODEL.name} (dummy weights)"
        name = name.replace("serve", "gate") + (f"-tp{probe.tp}" if probe.docker else "")
    report = None if probe.no_record else (probe.report or project.root / "docs" / "validation")
    return conclude(record, report, name)


def _local_runner(probe: ServeOptions, cache: Cache, project: Project, series: Series,
                  logs: Path, geometries: set[str]) -> tuple[LocalRunner, str, str]:
    if probe.tp != 1:
        raise E2Error("--tp above 1 needs --docker (the local CPU engine runs one worker)")
    env, view = prepare(project, series, cache, "cpu", overlay=True)
    assert view is not None
    models = {geometry: ensure_model(env.python, cache, geometry=geometry)
              for geometry in sorted(geometries)}
    shown = [str(m) for m in models.values()]
    run_env = {"stock": env.run_env(None), "e2": env.run_env(view.path)}
    runner = LocalRunner(env.python, view.path, run_env, models, logs, 1, probe.kv_cache_bytes)
    return runner, ", ".join(shown) or "no tiny model", "serve-cpu"


def _docker_runner(probe: ServeOptions, project: Project, series: Series,
                   logs: Path, geometries: set[str]) -> tuple[DockerRunner, str, str]:
    client = connect()  # first: an unreachable DOCKER_HOST fails before anything else
    images = engine_images(project, series, probe.stock_image, probe.e2_image)
    runner = DockerRunner(client, images, probe.gpus, probe.tp, logs, kv_bytes=probe.kv_cache_bytes)
    volumes = runner.ensure_models(geometries)
    return (runner, "docker volumes " + (", ".join(volumes) or "none"),
            "serve-gpu" if probe.gpus else "serve-docker")
