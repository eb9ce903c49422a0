"""e2 models: the id scan, the offline store's layout, and vLLM loading from it unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import git
import pytest
import yaml

from e2 import models
from e2.cache import Cache
from e2.errors import E2Error
from e2.validate import DEFAULT_SUITES
from validation_helpers import cpu_env  # noqa: F401 (fixture)

TEST_SOURCE = '''
MODEL = "org/model-a"
def test_x(path="images/cat.png", mime="image/png"):
    create(model="org/model-a")
    other = "Org2/Model_B-1.5"
'''
MODEL_CONFIG_SOURCE = '''
class ModelConfig:
    model: str = "Qwen/Qwen3-0.6B"
    tokenizer: str = "not/this"
'''


def test_scan_finds_repo_ids_with_their_places():
    found = models.scan_sources({"tests/t.py": TEST_SOURCE,
                                 models.MODEL_CONFIG_FILE: MODEL_CONFIG_SOURCE})
    assert found == {"Org2/Model_B-1.5": ["tests/t.py:5"],
                     "Qwen/Qwen3-0.6B": [f"{models.MODEL_CONFIG_FILE}:3"],
                     "image/png": ["tests/t.py:3"],
                     "org/model-a": ["tests/t.py:2", "tests/t.py:4"]}


def test_scan_refuses_what_it_cannot_read():
    with pytest.raises(E2Error, match=r"tests/bad.py:1: cannot parse"):
        models.scan_sources({"tests/bad.py": "def broken(:\n"})
    with pytest.raises(E2Error, match="no `model: str"):
        models.scan_sources({models.MODEL_CONFIG_FILE: "class ModelConfig:\n    pass\n"})


def test_scan_keeps_hand_kept_not_models(tmp_path):
    previous = models.IdsFile("0.31.0", ["tests"], {}, {"image/png": "a MIME type",
                                                        "gone/away": "no longer named"})
    repo = git.Repo.init(tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(TEST_SOURCE)
    (tmp_path / "vllm" / "config").mkdir(parents=True)
    (tmp_path / models.MODEL_CONFIG_FILE).write_text(MODEL_CONFIG_SOURCE)
    repo.index.add(["tests/t.py", models.MODEL_CONFIG_FILE])
    commit = repo.index.commit("upstream").hexsha
    ids = models.scan(repo, commit, "0.31.0", ["tests"], previous)
    assert ids.not_models == {"image/png": "a MIME type"}
    assert set(ids.models) == {"Org2/Model_B-1.5", "Qwen/Qwen3-0.6B", "org/model-a"}
    assert models.IdsFile.load(_written(tmp_path, ids)) == ids
    with pytest.raises(E2Error, match="no such suite in the upstream release: tests/nope"):
        models.scan(repo, commit, "0.31.0", ["tests/nope"], None)


def _written(tmp_path, ids: models.IdsFile):
    path = tmp_path / "ids.yaml"
    path.write_text(ids.dump())
    return path


def test_bad_model_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "MODELS", tmp_path / "models")
    folder = tmp_path / "models" / "org" / "broken"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["X"],\n  "hidden_size": }\n')
    cache = Cache(tmp_path / "cache")
    with pytest.raises(E2Error, match=r"org/broken/config.json:2:\d+: invalid JSON"):
        models.build_store(cache, python=sys.executable)
    (folder / "config.json").write_text('{"hidden_size": 8}\n')
    with pytest.raises(E2Error, match="org/broken has neither `architectures` nor `model_type`"):
        models.build_store(cache, python=sys.executable)
    assert not any(cache.hub_stores.glob(f"*/{models.DONE}"))


@pytest.mark.parametrize("spec, message", [
    ("dtype: bfloat16\nseed: 0\nextra: {mtp.fc.weight: [1024, 0]}\n",
     "extra maps a parameter name to its shape"),
    ("dtype: bfloat16\nseed: 0\nshaped_like: {mtp.layers.0.: 3}\n",
     "shaped_like maps a new prefix to an existing one"),
    ("dtype: bfloat16\nseed: 0\nextras: {}\n", "unknown keys ['extras']"),
])
def test_bad_weights_spec_is_named(tmp_path, spec, message):
    (tmp_path / "weights.yaml").write_text(spec)
    result = subprocess.run([sys.executable, str(models.WEIGHTS_MAKER), str(tmp_path / "weights.yaml"),
                             str(tmp_path), str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"{tmp_path / 'weights.yaml'}: ")
    assert message in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ids_file_is_a_fresh_scan_of_the_pinned_release(upstream_cache):
    """hub/ids.yaml is what the scan finds today, and every model it names has a folder."""
    checked_in = models.IdsFile.load()
    commit = upstream_cache.tag_commit(f"v{checked_in.upstream}")
    fresh = models.scan(git.Repo(upstream_cache.repo_dir), commit, checked_in.upstream,
                        list(DEFAULT_SUITES), checked_in)
    assert fresh == checked_in
    assert checked_in.suites == list(DEFAULT_SUITES)
    assert models.missing_models(checked_in) == []
    assert "facebook/opt-125m" in checked_in.models  # create_scheduler's default model


LOAD_EVERY_MODEL = r'''
import json, sys
from vllm.config import ModelConfig
from vllm.tokenizers import get_tokenizer
out = {}
for model_id in json.loads(sys.argv[1]):
    try:
        config = ModelConfig(model=model_id, skip_tokenizer_init=True)
    except Exception as exc:
        out[model_id] = {"error": str(exc)[:500]}
        continue
    text = config.hf_text_config
    entry = {"architectures": config.architectures, "layers": text.num_hidden_layers,
             "hidden_size": text.hidden_size, "max_model_len": config.max_model_len}
    if model_id in json.loads(sys.argv[2]):
        tokenizer = get_tokenizer(model_id)
        ids = tokenizer.encode("Hello, wörld", add_special_tokens=False)
        entry["roundtrip"] = tokenizer.decode(ids)
    if model_id in json.loads(sys.argv[3]):
        from huggingface_hub import snapshot_download  # offline: resolved in the store
        from safetensors import safe_open

        with safe_open(snapshot_download(model_id) + "/model.safetensors", "pt") as weights:
            names = list(weights.keys())
            embed = weights.get_slice(next(n for n in names if n.endswith("embed_tokens.weight")))
            entry["weights"] = {"tensors": len(names), "embed": list(embed.get_shape()),
                                "dtype": embed.get_dtype(),
                                "mtp": sum(n.startswith("mtp.") for n in names)}
    out[model_id] = entry
print(json.dumps(out))
'''


# vLLM imports their model classes to inspect them; in the CPU env that import
# needs torchvision (transformers' image processors), which the env removes.
NEED_TORCHVISION = {"llava-hf/llava-1.5-7b-hf", "Qwen/Qwen2.5-VL-3B-Instruct"}


@pytest.mark.slow
def test_vllm_loads_every_stored_model_offline(cpu_env, tmp_path):
    """vLLM's own ModelConfig (and tokenizer loader) resolve every id from the store alone."""
    store = models.build_store(Cache(tmp_path), cpu_env.python)
    assert models.build_store(Cache(tmp_path), cpu_env.python) == store  # reused, not rebuilt
    ids = sorted(models.IdsFile.load().models)
    with_tokenizer = [i for i in ids if (models.model_dir(i) / models.TOKENIZER_SPEC).is_file()]
    with_weights = [i for i in ids if (models.model_dir(i) / models.WEIGHTS_SPEC).is_file()]
    env = {**cpu_env.run_env(None), "HF_HUB_CACHE": str(store)}
    result = subprocess.run([str(cpu_env.python), "-P", "-c", LOAD_EVERY_MODEL, json.dumps(ids),
                             json.dumps(with_tokenizer), json.dumps(with_weights)],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(loaded) == ids
    for model_id in NEED_TORCHVISION:
        assert "failed to be inspected" in loaded.pop(model_id)["error"], model_id
    for model_id, entry in loaded.items():
        assert "error" not in entry, (model_id, entry)
        config = json.loads((models.model_dir(model_id) / "config.json").read_text())
        text = config.get("text_config") or config
        assert entry["architectures"] == config["architectures"], model_id
        assert entry["layers"] == text["num_hidden_layers"], model_id
        assert entry["hidden_size"] == text["hidden_size"], model_id
        if model_id in with_tokenizer:
            assert entry["roundtrip"] == "Hello, wörld", model_id
        if model_id in with_weights:  # the published embedding shape, in the spec's dtype
            dtype = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[yaml.safe_load(
                (models.model_dir(model_id) / models.WEIGHTS_SPEC).read_text())["dtype"]]
            width = text.get("word_embed_proj_dim", text["hidden_size"])
            assert entry["weights"]["embed"] == [text["vocab_size"], width], model_id
            assert entry["weights"]["dtype"] == dtype and entry["weights"]["tensors"] > 4
            # Qwen3.5's MTP head: layer 3's 11 tensors under mtp.layers.0, fc and 3 norms
            assert entry["weights"]["mtp"] == (15 if model_id == "Qwen/Qwen3.5-0.8B" else 0)
    snapshot = store / "models--facebook--opt-125m"
    commit = (snapshot / "refs" / "main").read_text()
    assert (snapshot / "snapshots" / commit / "config.json").is_file()
    # weights only where a model's folder asks for them
    assert sorted(p.parent.parent.parent.name for p in store.rglob("*.safetensors")) == sorted(
        "models--" + i.replace("/", "--") for i in with_weights)
    assert set(with_weights) == {"facebook/opt-125m", "hmellor/tiny-random-LlamaForCausalLM",
                                 "Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B"}
    assert not list(store.rglob("*.bin"))
