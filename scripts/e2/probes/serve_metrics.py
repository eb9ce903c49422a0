"""What a serve probe engine reports about itself: /metrics, its log, its resolved config.

The cases are cut from these figures (block size, KV capacity), and the
comparison reads the path counters (prefix-cache hits, preemptions) from
/metrics before and after each case.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from e2 import console
from e2.errors import E2Error
from e2.probes.engines import Engine

_KV_LINE = re.compile(r"(\w+ KV cache size: [\d,]+ tokens, Maximum concurrency for [\d,]+ "
                      r"tokens per request: [\d.]+x)")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_METRIC = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_E2_BANNER = re.compile(r"(vLLM E2 series \w+ .*)$", re.M)


def metrics(engine: Engine) -> dict[str, float]:
    """Counters summed over engines, and cache_config_info's labels as ``info.<label>``."""
    text = engine.get("/metrics")
    values: dict[str, float] = {}
    for name, labels, value in _METRIC.findall(text):
        if name == "vllm:cache_config_info":
            for key, label in _LABEL.findall(labels):
                values[f"info.{key}"] = label  # the label's text, not a number
            continue
        values[name] = values.get(name, 0.0) + float(value)
    return values


@dataclass
class EngineInfo:
    side: str
    mode: str
    boot_s: float
    block_size: int
    num_blocks: int | None
    kv_capacity_tokens: int
    kv_line: str
    async_requested: bool
    async_resolved: bool | None
    enable_prefix_caching: bool | None
    mamba_cache_mode: str | None
    e2_banner: str | None               # E2's boot report line: present on E2 only


def inspect_engine(engine: Engine) -> EngineInfo:
    log = engine.log()
    line = _KV_LINE.search(log)
    found = metrics(engine)
    if line is None:
        raise E2Error(f"{engine.side} engine ({engine.mode}): no 'KV cache size' line in its "
                      "log", hint="the engine's log format changed: update _KV_LINE")
    tokens_found = _KV_TOKENS.search(line.group(1))
    assert tokens_found is not None  # _KV_LINE's group holds "KV cache size: N tokens"
    tokens = int(tokens_found.group(1).replace(",", ""))
    block = found.get("info.block_size")
    if block is None:
        raise E2Error(f"{engine.side} engine ({engine.mode}): no vllm:cache_config_info "
                      "block_size in /metrics")
    try:
        config = json.loads(engine.get("/server_info?config_format=json"))["vllm_config"]
        resolved = config["scheduler_config"].get("async_scheduling")
        cache = config["cache_config"]
    except (OSError, E2Error, KeyError, json.JSONDecodeError) as exc:
        console.warn(f"{engine.side} ({engine.mode}): no resolved config from /server_info "
                     f"({exc}); async scheduling state unknown")
        resolved, cache = None, {}
    blocks = found.get("info.num_gpu_blocks")
    banner = _E2_BANNER.search(log)
    return EngineInfo(
        engine.side, engine.mode, engine.boot_s, int(block),
        int(blocks) if blocks not in (None, "None") else None, tokens, line.group(1),
        engine.mode == "async", resolved, cache.get("enable_prefix_caching"),
        cache.get("mamba_cache_mode"), banner.group(1) if banner else None)
