# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 series information and the engine boot report.

The E2 build writes `e2_series.json` next to this module, e.g.::

    {
        "series_digest": "<64 hex>",
        "upstream_version": "0.31.0",
        "patches": [
            {"id": "0001", "title": "...", "switch": "VLLM_E2_REPORT", "default": "1"}
        ],
    }
"""

import json
import logging
from pathlib import Path
from typing import Any

from vllm import envs
from vllm.e2_switches import validate_e2_switches


def series_info_path() -> Path:
    """Location of the series file written by the E2 build."""
    return Path(__file__).with_name("e2_series.json")


def load_series_info() -> dict[str, Any] | None:
    """Return the parsed series file, or None when it is absent."""
    path = series_info_path()
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def boot_report() -> str:
    """One line naming the E2 series and the value of every E2 switch."""
    switches = ", ".join(
        f"{name}={int(value)}" for name, value in validate_e2_switches().items()
    )
    info = load_series_info()
    if info is None:
        return f"vLLM E2 series unknown (no vllm/e2_series.json): {switches}"
    return (
        f"vLLM E2 series {info['series_digest'][:12]} "
        f"({len(info['patches'])} patches on vLLM {info['upstream_version']}): "
        f"{switches}"
    )


def log_boot_report(log: logging.Logger, enabled: bool) -> bool:
    """Log `boot_report()` when enabled (VLLM_E2_REPORT); return whether it
    logged. Disabled leaves the upstream log untouched."""
    if not enabled:
        return False
    log.info("%s", boot_report())
    return True


def check_switches_and_report(log: logging.Logger, first_local_rank: bool) -> None:
    """The engine core's start: every VLLM_E2_* value checked on every rank (a
    malformed one raises), the report logged by a node's first rank when
    VLLM_E2_REPORT is on."""
    validate_e2_switches()
    if first_local_rank:
        log_boot_report(log, enabled=envs.VLLM_E2_REPORT)
