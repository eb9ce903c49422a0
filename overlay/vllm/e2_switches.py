# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 switches: the registry of every ``VLLM_E2_*`` environment variable
and its strict parsing. vllm/envs.py serves each as ``envs.<NAME>``; each
patch of the series registers its own switch here."""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class E2Switch:
    """A vLLM E2 on/off switch (environment variable ``VLLM_E2_*``)."""

    name: str
    default: bool
    # Path, relative to the directory holding the `vllm` package, of the
    # file that reads the switch.
    read_in: str
    # Whether the switch changes compiled or cached artifacts (if so it is
    # hashed by `compile_factors()`).
    compiled: bool
    doc: str


# Registry of every vLLM E2 switch. Values are strictly "0" or "1".
E2_SWITCHES: dict[str, E2Switch] = {
    s.name: s
    for s in (
        E2Switch(
            name="VLLM_E2_REPORT",
            default=True,
            read_in="vllm/e2.py",
            compiled=False,
            doc="Log the E2 series digest and every switch value "
            "when the engine starts.",
        ),
        E2Switch(
            name="VLLM_E2_STATE_POOL",
            default=True,
            read_in="vllm/v1/core/state_pool/planner.py",
            compiled=False,
            doc="Hybrid models: attention at the backend's natural block size, "
            "cut from the state-sized pages of the shared pool.",
        ),
    )
}


def parse_e2_switch(name: str) -> bool:
    """Parse a registered E2 switch: unset -> default, else "0" or "1"."""
    if name not in E2_SWITCHES:
        raise KeyError(f"{name} is not a registered vLLM E2 switch")
    value = os.environ.get(name)
    if value is None:
        return E2_SWITCHES[name].default
    if value not in ("0", "1"):
        raise ValueError(
            f"Invalid value for {name}: {value!r}. Allowed values are '0' or '1'."
        )
    return value == "1"


def validate_e2_switches() -> dict[str, bool]:
    """Parse every registered E2 switch; report all bad values at once."""
    values: dict[str, bool] = {}
    errors: list[str] = []
    for name in E2_SWITCHES:
        try:
            values[name] = parse_e2_switch(name)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ValueError("; ".join(errors))
    return values
