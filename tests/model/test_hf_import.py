"""Hugging Face import/export without torch: golden fixtures, config mapping, bad inputs.

The fixtures under tests/model/fixtures/hf/ are tiny random models of each supported family
(bf16 weights) with transformers' float32 logits and greedy tokens, made by
tests/model/make_hf_fixtures.py. The torch tier (test_hf_torch.py) checks the same live.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from make_hf_fixtures import FIXTURES, N_NEW, SPECS, write_tokenizer
from safetensors import safe_open

from needle.config import LoraConfig, model_preset
from needle.errors import ModelImportError, NeedleError
from needle.eval.decode import generate
from needle.model.hf.config import hf_config_to_model_config, is_hf_model_dir, resolve_model_source
from needle.model.hf.export import export_hf, export_peft, model_config_to_hf_config
from needle.model.hf.weights import hf_key_map, load_hf_params
from needle.model.io import load_model, save_model
from needle.model.lora import attach_base, init_params, merge_lora
from needle.model.decoder.transformer import Transformer

ARCHS = sorted(SPECS)


def _fixture(name: str) -> tuple[Path, dict]:
    d = FIXTURES / name
    return d, json.loads((d / "expected.json").read_text())


def _real_logits(logits: np.ndarray, lengths: list[int]) -> np.ndarray:
    return np.concatenate([logits[row, :n] for row, n in enumerate(lengths)])


@pytest.fixture
def hf_copy(tmp_path: Path):
    """``hf_copy(name)``: a writable copy of a fixture dir with a tokenizer added."""

    def make(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(FIXTURES / name, d)
        write_tokenizer(d)
        return d

    return make


@pytest.mark.parametrize("name", ARCHS)
def test_golden_logits_and_greedy(name, logits_of):
    d, expected = _fixture(name)
    cfg = hf_config_to_model_config(d)
    assert cfg.arch == name and is_hf_model_dir(d)
    params = load_hf_params(d, cfg)
    assert jax.tree.leaves(params)[0].dtype == jnp.bfloat16  # kept as stored until placed
    model = Transformer(cfg)
    logits = np.asarray(logits_of(model, params, jnp.asarray(expected["tokens"], jnp.int32)))
    want = np.load(d / "expected_logits.npy", allow_pickle=False)
    np.testing.assert_allclose(_real_logits(logits, expected["lengths"]), want, atol=1e-4, rtol=0)
    prompts = [row[:n] for row, n in zip(expected["tokens"], expected["lengths"])]
    # end_id -1 never occurs: exactly N_NEW tokens, as transformers generated them.
    got = generate(model, params, prompts, max_new_tokens=N_NEW, end_id=-1, pad_id=0, batch_size=2)
    assert got == expected["greedy"]


def test_config_switches_per_family():
    llama = hf_config_to_model_config(FIXTURES / "llama")
    assert llama.rope_scaling.type == "llama3" and llama.rope_scaling.original_max_len == 16
    assert not llama.tie_embeddings and llama.head_dim == 12 and llama.max_len == 128
    assert hf_config_to_model_config(FIXTURES / "qwen2").qkv_bias
    qwen3 = hf_config_to_model_config(FIXTURES / "qwen3", max_len=64)
    assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.d_model == 48 and qwen3.max_len == 64
    gemma = hf_config_to_model_config(FIXTURES / "gemma3_text")
    assert (gemma.norm_offset_one, gemma.post_norms, gemma.embed_scale, gemma.mlp_act) == (True, True, True, "gelu_tanh")
    assert gemma.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (gemma.sliding_window, gemma.rope_theta, gemma.rope_local_theta) == (4, 1e6, 1e4)
    assert gemma.query_pre_attn_scalar == 24 and gemma.final_softcap is None


def test_transformers4_config_layouts():
    """Hub configs written by transformers 4: rope_theta/rope_scaling, Gemma's pattern and local base."""
    gemma = json.loads((FIXTURES / "gemma3_text" / "config.json").read_text())
    del gemma["layer_types"], gemma["rope_parameters"]
    gemma.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = hf_config_to_model_config(gemma)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.rope_scaling.type == "linear" and cfg.rope_local_theta == 1e4
    qwen = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
    del qwen["layer_types"], qwen["rope_parameters"]
    qwen.update(rope_theta=1e6, use_sliding_window=False, sliding_window=32768, rope_scaling=None)
    cfg = hf_config_to_model_config(qwen)
    assert cfg.layer_types is None and cfg.sliding_window is None and cfg.rope_theta == 1e6


def test_lora_on_imported_model_merges_exactly(logits_of):
    cfg = hf_config_to_model_config(FIXTURES / "gemma3_text")
    base = jax.tree.map(lambda x: x.astype(jnp.float32), load_hf_params(FIXTURES / "gemma3_text", cfg))
    lora = LoraConfig(rank=2, alpha=4.0)
    params = attach_base(init_params(cfg, lora, 1), base)
    flat = traverse_util.flatten_dict(params)
    assert {k[-2] for k in flat if k[-1] == "lora_a"} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    rng = np.random.default_rng(0)
    flat = {k: (rng.normal(0, 0.1, v.shape).astype(np.float32) if k[-1] == "lora_b" else v) for k, v in flat.items()}
    params = traverse_util.unflatten_dict(flat)
    tokens = jnp.asarray(_fixture("gemma3_text")[1]["tokens"], jnp.int32)
    with_adapters = logits_of(Transformer(cfg, lora), params, tokens)
    merged = logits_of(Transformer(cfg), merge_lora(params, lora), tokens)
    np.testing.assert_allclose(np.asarray(with_adapters), np.asarray(merged), atol=1e-4)
    assert float(jnp.max(jnp.abs(with_adapters - logits_of(Transformer(cfg), base, tokens)))) > 1e-2


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
def test_load_model_dispatch_save_round_trip_and_exact_export(name, hf_copy, tmp_path, logits_of):
    d = hf_copy(name)
    loaded = load_model(d)
    assert loaded.meta["base"] == {"source": str(d), "revision": None, "commit": None, "arch": name,
                                   "n_params": loaded.meta["base"]["n_params"]}  # fmt: skip
    assert loaded.meta["base"]["n_params"] == sum(x.size for x in jax.tree.leaves(loaded.params))
    # A native save of the imported model reads back as the same config (HF config included).
    native = save_model(tmp_path / "native", loaded.params, loaded.model_cfg, loaded.tokenizer, loaded.meta)
    again = load_model(native)
    assert again.model_cfg == loaded.model_cfg and json.loads(again.model_cfg.hf_config)["model_type"] == name
    tokens = jnp.asarray(_fixture(name)[1]["tokens"], jnp.int32)
    model = Transformer(loaded.model_cfg)
    np.testing.assert_allclose(
        np.asarray(logits_of(model, again.params, tokens)), np.asarray(logits_of(model, loaded.params, tokens)), atol=0
    )
    # Exported untouched (even after the float32 native round trip): the original tensors, bit for bit.
    out = export_hf(again, None, None, tmp_path / "hf")
    with safe_open(d / "model.safetensors", "flax") as a, safe_open(out / "model.safetensors", "flax") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype == jnp.bfloat16, k
            np.testing.assert_array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16), err_msg=k)
    assert json.loads((out / "config.json").read_text())["model_type"] == name
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert load_model(out).model_cfg == loaded.model_cfg


def test_native_model_exports_as_llama(tmp_path):
    cfg = model_preset("tiny")
    hf = model_config_to_hf_config(cfg)
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["head_dim"] == cfg.head_dim
    # Back through the importer: the same transformer, switches off.
    back = hf_config_to_model_config(hf)
    assert back.model_dump(exclude={"preset", "arch", "hf_config"}) == cfg.model_dump(exclude={"preset", "arch", "hf_config"})
    with pytest.raises(ModelImportError, match="not exactly a Llama.*qk_norm"):
        model_config_to_hf_config(cfg.model_copy(update={"qk_norm": True}))
    params = init_params(cfg, None, 0)
    out = export_hf(params, cfg, None, tmp_path / "hf")
    reloaded = load_hf_params(out, hf_config_to_model_config(out))
    for path, x in traverse_util.flatten_dict(params).items():
        np.testing.assert_array_equal(np.asarray(traverse_util.flatten_dict(reloaded)[path]), np.asarray(x))


def test_peft_export_names_and_shapes(tmp_path):
    cfg = hf_config_to_model_config(FIXTURES / "qwen3")
    lora = LoraConfig(rank=2, alpha=8.0, targets=("q", "down"))
    out = export_peft(init_params(cfg, lora, 0), lora, {"source": "Qwen/Qwen3-0.6B", "revision": "main"}, tmp_path / "a")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 8.0, ["down_proj", "q_proj"])
    with safe_open(out / "adapter_model.safetensors", "flax") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"] == (2, 48)
    assert shapes["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"] == (4 * 16, 2)
    assert shapes["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"] == (48, 2)
    assert len(shapes) == 2 * 2 * cfg.n_layers


# --- bad inputs: each a NeedleError naming the file, key or field ---------------------------


def test_not_a_model_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FileNotFoundError, match="nor is it a Hugging Face model"):
        load_model(tmp_path)
    with pytest.raises(ModelImportError, match="no such model directory"):
        resolve_model_source(tmp_path / "absent")


def test_unsupported_model_type(hf_copy):
    d = hf_copy("llama")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ModelImportError, match="model_type 'mamba' is not supported; supported: llama, qwen2"):
        load_model(d)
    with pytest.raises(ModelImportError, match="rope_type 'yarn' is not supported"):
        hf_config_to_model_config({**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}})


def _rewrite_weights(d: Path, edit) -> None:
    from safetensors.flax import save_file

    with safe_open(d / "model.safetensors", "flax") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit(tensors), str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors(hf_copy):
    d = hf_copy("qwen2")
    key = "model.layers.1.self_attn.k_proj.bias"
    _rewrite_weights(d, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(ModelImportError, match=rf"missing tensor {key} \(shape \[24\]\)"):
        load_model(d)
    _rewrite_weights(d, lambda t: {**t, key: jnp.zeros((25,), jnp.bfloat16), "model.extra.weight": jnp.zeros((2,))})
    with pytest.raises(ModelImportError) as err:
        load_model(d)
    assert f"tensor {key} has shape [25], config.json implies [24]" in str(err.value)
    assert "unexpected tensor model.extra.weight" in str(err.value)


def test_truncated_safetensors_and_sharded_index(hf_copy):
    d = hf_copy("llama")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelImportError, match=r"model.safetensors: not a complete safetensors file"):
        load_model(d)
    # A sharded checkpoint whose index names a shard that is not there.
    (d / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in hf_key_map(hf_config_to_model_config(d))}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelImportError, match="model-00001-of-00002.safetensors: shard listed in"):
        load_model(d)


def test_sharded_checkpoint_loads(hf_copy, logits_of):
    from safetensors.flax import save_file

    d = hf_copy("qwen3")
    with safe_open(d / "model.safetensors", "flax") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(d / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in shards.items() for k in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "model.safetensors").unlink()
    single = load_hf_params(FIXTURES / "qwen3", hf_config_to_model_config(FIXTURES / "qwen3"))
    sharded = load_model(d).params
    for path, x in traverse_util.flatten_dict(single).items():
        np.testing.assert_array_equal(np.asarray(traverse_util.flatten_dict(sharded)[path]), np.asarray(x))


def test_tokenizer_larger_than_embedding(hf_copy):
    d = hf_copy("llama")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(ModelImportError, match=r"tokenizer.json has \d+ tokens but the embedding only 100 rows"):
        load_model(d)


def test_hub_id_offline_fails_at_once(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelImportError, match=r"hf:nobody/nothing@v1: not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        load_model("hf:nobody/nothing@v1")
    with pytest.raises(NeedleError, match="expected hf:owner/name"):
        resolve_model_source("hf:bad id")


def test_softcapped_attention_path(logits_of):
    """The explicit soft-capped attention (sliding and full layers) equals the fused path when the
    cap is far above every logit, and differs under a tight cap."""
    cfg = hf_config_to_model_config(FIXTURES / "gemma3_text")
    params = load_hf_params(FIXTURES / "gemma3_text", cfg)
    tokens = jnp.asarray(_fixture("gemma3_text")[1]["tokens"], jnp.int32)
    plain = logits_of(Transformer(cfg), params, tokens)
    loose = logits_of(Transformer(cfg.model_copy(update={"attn_softcap": 1e6})), params, tokens)
    tight = logits_of(Transformer(cfg.model_copy(update={"attn_softcap": 0.5})), params, tokens)
    np.testing.assert_allclose(np.asarray(loose), np.asarray(plain), atol=1e-4)
    assert float(jnp.max(jnp.abs(tight - plain))) > 1e-2
