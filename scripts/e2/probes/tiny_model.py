"""Write a tiny random-weight Qwen3-Next-shaped model (3 Gated DeltaNet layers, 1 full attention).

Runs under a python with torch and transformers (the e2 env's venv, or an
engine image), never the driver's: ``python tiny_model.py OUT [--seed N]
[--geometry hybrid|align]``.
The weights depend on the seed only, so stock and E2 serve the same model.
Stdlib + torch + transformers only: e2.probes.serve_model also runs this
file's source inside an engine container.

Shape choices: linear-attention (GDN) head dims are 128 because the CPU GDN
kernels want them; 4 GDN heads and 8 KV heads split evenly for tensor
parallel 1, 2 or 4; the full-attention layer's 8 KV heads of 128 make one
token's attention page large enough for the hybrid page alignment to land on
a small block (the engine picks the block size; the probe reads it).

The ``align`` geometry is the same model with a small attention layer (4 KV
heads of 32): one token's attention page is then a sixteenth of the hybrid's,
so stock raises its block to 288 tokens or more to hold a state, as on the
real models (Qwen3.5-0.8B: 544), while E2 keeps its natural attention block
and checkpoints states every 256 tokens in mamba ``align`` mode.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, head_dim=128,
    linear_num_key_heads=4, linear_num_value_heads=4,
    linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, max_position_embeddings=2048,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
GEOMETRIES = {"hybrid": CONFIG,
              "align": {**CONFIG, "num_key_value_heads": 4, "head_dim": 32}}
DONE = "e2-tiny-model.json"  # written last: marks a complete model folder


def write(out: str, seed: int, geometry: str = "hybrid") -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    staging = out.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    torch.manual_seed(seed)
    config = GEOMETRIES[geometry]
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(staging)
    with open(os.path.join(staging, DONE), "w") as handle:
        json.dump({"seed": seed, "geometry": geometry, "config": config, "torch": torch.__version__,
                   "parameters": sum(p.numel() for p in model.parameters())}, handle,
                  indent=2, sort_keys=True)
    if os.path.isdir(out):  # a container writes into a mounted volume: fill it in place
        for name in os.listdir(staging):
            shutil.move(os.path.join(staging, name), os.path.join(out, name))  # across mounts
        os.rmdir(staging)
    else:
        os.rename(staging, out)
    print(f"model written to {out} (seed {seed}, geometry {geometry})")


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: tiny_model.py OUT [--seed N] [--geometry hybrid|align]", file=sys.stderr)
        return 2
    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
    geometry = argv[argv.index("--geometry") + 1] if "--geometry" in argv else "hybrid"
    if geometry not in GEOMETRIES:
        print(f"tiny_model.py: unknown geometry {geometry!r} (one of "
              f"{', '.join(GEOMETRIES)})", file=sys.stderr)
        return 2
    write(argv[0], seed, geometry)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
