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
as the published checkpoints do. The model class is the one the config's
``architectures`` names, so a multimodal checkpoint keeps its towers' names.

What a checkpoint holds beyond transformers' model (an MTP head that vLLM loads
as a draft model) is named in the spec: ``shaped_like`` copies the shapes of
one parameter prefix under another, ``extra`` gives names and shapes outright.
Stdlib + torch + transformers + safetensors.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

FIELDS = {"dtype", "seed", "shaped_like", "extra"}
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
    if not all(isinstance(k, str) and isinstance(v, str)
               for k, v in (spec.get("shaped_like") or {}).items()):
        raise SystemExit(f"{path}: shaped_like maps a new prefix to an existing one")
    if not all(isinstance(v, list) and v and all(isinstance(n, int) and n > 0 for n in v)
               for v in (spec.get("extra") or {}).values()):
        raise SystemExit(f"{path}: extra maps a parameter name to its shape, a list of sizes")
    return spec


def build_model(config: PretrainedConfig) -> PreTrainedModel:
    """The class ``architectures`` names where transformers has it, else the causal LM."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def shapes(config: PretrainedConfig, spec: dict) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape: the model ``config`` describes, plus the spec's
    ``shaped_like`` copies and ``extra`` parameters."""
    import torch

    with torch.device("meta"):
        model = build_model(config)
    # named_parameters lists a tied parameter once, under its first name
    found = {name: tuple(param.shape) for name, param in model.named_parameters()}
    for new, old in (spec.get("shaped_like") or {}).items():
        copied = {new + name[len(old):]: shape for name, shape in found.items()
                  if name.startswith(old)}
        if not copied:
            raise SystemExit(f"shaped_like: no parameter of the model starts with {old!r}")
        found.update(copied)
    found.update({name: tuple(shape) for name, shape in (spec.get("extra") or {}).items()})
    return found


def write(spec_path: str, config_dir: str, out: str) -> None:
    spec = load_spec(spec_path)  # a bad spec is named before the heavy imports
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_dir)
    std = float(getattr(config, "initializer_range", None) or getattr(config, "init_std", None)
                or 0.02)
    dtype = getattr(torch, spec["dtype"])
    tensors = {}
    for name, shape in shapes(config, spec).items():
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
