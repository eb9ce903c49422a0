"""Write seeded random weights at a model's published shapes (no hub).

Runs under the test env's python (it has ``torch``, ``transformers`` and
``safetensors``; the driver does not): ``python make_weights.py SPEC CONFIG OUT``.

A test that only loads a model's weights (vLLM's loader, a runner's
``reload_weights``) or runs it for token ids it compares with itself needs
tensors of the right names, shapes and dtype, not the trained values. The
model is built from its ``config.json`` on the meta device (no memory), so the
names and shapes are transformers' own for that architecture; each parameter
is drawn from a normal distribution (the config's ``initializer_range`` or
``init_std``) with a generator seeded from the spec's seed and the parameter's
name, so the same inputs give the same file. Tied parameters are written once,
as the published checkpoints do. Stdlib + torch + transformers + safetensors.
"""

from __future__ import annotations

import hashlib
import os
import sys

FIELDS = {"dtype", "seed"}
DTYPES = ("float32", "float16", "bfloat16")


def load_spec(path: str) -> dict:
    import yaml  # a dependency of transformers, so present wherever this runs

    with open(path) as handle:
        spec = yaml.safe_load(handle) or {}
    unknown = set(spec) - FIELDS
    if unknown:
        raise SystemExit(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(FIELDS)}")
    if spec.get("dtype") not in DTYPES:
        raise SystemExit(f"{path}: dtype must be one of {', '.join(DTYPES)}")
    if not isinstance(spec.get("seed"), int):
        raise SystemExit(f"{path}: seed must be an integer")
    return spec


def shapes(config_dir: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model ``config_dir/config.json`` describes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters lists a tied parameter once, under its first name
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def write(spec_path: str, config_dir: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    spec = load_spec(spec_path)
    config = AutoConfig.from_pretrained(config_dir)
    std = float(getattr(config, "initializer_range", None) or getattr(config, "init_std", None)
                or 0.02)
    dtype = getattr(torch, spec["dtype"])
    tensors = {}
    for name, shape in shapes(config_dir).items():
        seed = int.from_bytes(hashlib.sha256(f"{spec['seed']}:{name}".encode()).digest()[:8],
                              "little") >> 1
        generator = torch.Generator().manual_seed(seed)
        tensors[name] = (torch.randn(shape, generator=generator) * std).to(dtype)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: make_weights.py SPEC CONFIG_DIR OUT", file=sys.stderr)
        return 2
    write(*argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
