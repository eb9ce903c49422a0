"""e2 probe: measure what the series changes, stock vs E2.

* ``capacity`` (probes/capacity*.py): how many tokens and requests a hybrid
  model's KV pool holds, planned as a CUDA boot on the target GPU would, and the
  scenario matrix behind docs/capacity-baseline.md.
* ``serve`` (probes/serve.py): stock and E2 engines serving a tiny hybrid model,
  token for token.
"""

from __future__ import annotations

import argparse

from e2.probes.capacity_cli import DESCRIPTION, add_capacity_arguments
from e2.probes.serve import add_serve_arguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe", help="measure what the series changes: KV capacity of hybrid models",
        description="Probes that run vLLM's own code in the test venv, stock and E2.")
    probes = parser.add_subparsers(dest="probe", metavar="PROBE", required=True)
    cap = probes.add_parser(
        "capacity", help="KV pool size and scheduler saturation for hybrid models",
        description=DESCRIPTION)
    add_capacity_arguments(cap)
    serve = probes.add_parser(
        "serve", help="stock vs E2 engines serving a tiny hybrid model, token for token",
        description="Serve a tiny random-weight Qwen3-Next model with stock and E2 vLLM "
                    "(the local e2 env, or --docker images on DOCKER_HOST) and compare "
                    "output token ids request by request: prompts of block-1, block and "
                    "block+1 tokens, a shared prefix, more requests than fit (preemption), "
                    "sync and async scheduling. Any mismatch fails; records go to "
                    "docs/validation/.")
    add_serve_arguments(serve)
