"""Make a model's tokenizer files locally from its tokenizer.yaml (no hub).

Runs under the test env's python (it has ``tokenizers`` and ``transformers``;
the driver does not): ``python make_tokenizer.py SPEC OUT``.

The tokenizer is byte-level BPE over the 256 bytes with no merges: any text
encodes (one token per byte) and decodes back exactly. Its vocabulary is
padded with filler tokens to the model's size, and the special tokens sit at
the ids the model's config names (``image_token_index`` and the like), which
is what processors and the tests read. Stdlib + tokenizers + transformers only.
"""

from __future__ import annotations

import json
import os
import sys

FIELDS = {"vocab_size", "special_tokens", "bos_token", "eos_token", "pad_token", "unk_token",
          "chat_template", "model_max_length", "extra_config"}


def load_spec(path: str) -> dict:
    import yaml  # a dependency of transformers, so present wherever this runs

    with open(path) as handle:
        spec = yaml.safe_load(handle)
    unknown = set(spec) - FIELDS
    if unknown:
        raise SystemExit(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(FIELDS)}")
    if not isinstance(spec.get("vocab_size"), int) or spec["vocab_size"] < 256:
        raise SystemExit(f"{path}: vocab_size must be an integer of at least 256")
    return spec


def build_vocab(vocab_size: int, special: dict[str, int]) -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    taken = set(special.values())
    free = (i for i in range(vocab_size + len(special)) if i not in taken)
    vocab = dict(special)
    for symbol in sorted(ByteLevel.alphabet()):
        vocab[symbol] = next(free)
    for index, token_id in enumerate(free):
        if token_id >= vocab_size:
            break
        vocab[f"<|filler_{index}|>"] = token_id
    return vocab


def write(spec_path: str, out: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = load_spec(spec_path)
    special = {str(k): int(v) for k, v in (spec.get("special_tokens") or {}).items()}
    tokenizer = Tokenizer(models.BPE(vocab=build_vocab(spec["vocab_size"], special), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in sorted(special, key=special.__getitem__)])
    roles = {k: spec[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if spec.get(k)}
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                      model_max_length=spec.get("model_max_length", 1 << 20),
                                      **roles)
    if spec.get("chat_template"):
        wrapped.chat_template = spec["chat_template"]
    os.makedirs(out, exist_ok=True)
    wrapped.save_pretrained(out)
    config_path = os.path.join(out, "tokenizer_config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    config.update(spec.get("extra_config") or {})
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: make_tokenizer.py SPEC OUT", file=sys.stderr)
        return 2
    write(argv[0], argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
