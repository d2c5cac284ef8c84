"""Hugging Face safetensors <-> needle parameter trees, tensor by tensor.

``hf_key_map(cfg)`` names every checkpoint tensor of a config and where it goes in needle's
tree (``[out, in]`` linear weights are transposed to needle's ``[in, out]`` kernels).
``load_hf_params(dir, cfg)`` checks the checkpoint against that map first (missing, unexpected
and wrongly shaped tensors are all named before a byte of weights is read; ``safetensors``
parses the headers and rejects truncated files) and then reads one tensor at a time, largest
first, into a host buffer that is placed on the default device and freed: peak RSS stays near
one copy of the parameters (1.04x the checkpoint above the process baseline for a 533M-param
bf16 checkpoint, bench/hf_load.py). Tensors keep the checkpoint's dtype (bf16 stays bf16); the
model casts them to the backend's compute dtype when it runs.

    cfg = hf_config_to_model_config(model_dir)
    params = load_hf_params(model_dir, cfg)
    tensors = params_to_hf_tensors(params, cfg, "bfloat16")   # the inverse, for export
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from needle.config import ModelConfig
from needle.errors import ModelImportError
from needle.model.factory import abstract_params
from needle.model.lora import Params

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
KeyMap = dict[str, tuple[tuple[str, ...], bool]]


def _layer_keys(cfg: ModelConfig, i: int) -> KeyMap:
    hf, b = f"model.layers.{i}.", f"block_{i}"
    keys: KeyMap = {hf + "input_layernorm.weight": ((b, "attn_norm", "scale"), False)}
    if cfg.post_norms:  # Gemma: post_attention_layernorm is the attention output's norm
        keys[hf + "post_attention_layernorm.weight"] = ((b, "post_attn_norm", "scale"), False)
        keys[hf + "pre_feedforward_layernorm.weight"] = ((b, "mlp_norm", "scale"), False)
        keys[hf + "post_feedforward_layernorm.weight"] = ((b, "post_mlp_norm", "scale"), False)
    else:  # Llama/Qwen: post_attention_layernorm is the MLP's input norm
        keys[hf + "post_attention_layernorm.weight"] = ((b, "mlp_norm", "scale"), False)
    for p in ("q", "k", "v", "o"):
        keys[f"{hf}self_attn.{p}_proj.weight"] = ((b, "attn", f"{p}_proj", "kernel"), True)
        if (cfg.qkv_bias and p != "o") or (cfg.o_bias and p == "o"):
            keys[f"{hf}self_attn.{p}_proj.bias"] = ((b, "attn", f"{p}_proj", "bias"), False)
    if cfg.qk_norm:
        for p in ("q", "k"):
            keys[f"{hf}self_attn.{p}_norm.weight"] = ((b, "attn", f"{p}_norm", "scale"), False)
    for p in ("gate", "up", "down"):
        keys[f"{hf}mlp.{p}_proj.weight"] = ((b, "mlp", f"{p}_proj", "kernel"), True)
    return keys


def hf_key_map(cfg: ModelConfig) -> KeyMap:
    """``{hf_key: (needle_path, transposed)}`` for every tensor a checkpoint of ``cfg`` holds."""
    keys: KeyMap = {
        "model.embed_tokens.weight": (("embed", "embedding"), False),
        "model.norm.weight": (("final_norm", "scale"), False),
    }
    if not cfg.tie_embeddings:
        keys["lm_head.weight"] = (("lm_head", "kernel"), True)
    for i in range(cfg.n_layers):
        keys.update(_layer_keys(cfg, i))
    return keys


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint shape of every tensor in :func:`hf_key_map` (HF layout), without building params."""
    flat = traverse_util.flatten_dict(abstract_params(cfg))
    return {k: tuple(flat[path].shape[::-1] if t else flat[path].shape) for k, (path, t) in hf_key_map(cfg).items()}


def safetensors_files(model_dir: Path) -> dict[str, Path]:
    """``{tensor key: file}`` from the shard index, or every key of the single model.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelImportError(f"{index}: not a safetensors index (no weight_map): {e}") from e
        return {k: model_dir / f for k, f in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
        hint = f" (found {', '.join(others)}: only safetensors weights are read)" if others else ""
        raise ModelImportError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    return {k: single for k in _header(single)}


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype)}`` of one safetensors file; a truncated or corrupt file is named."""
    from safetensors import safe_open

    if not path.is_file():
        raise ModelImportError(f"{path}: shard listed in {INDEX_FILE} is missing")
    try:
        with safe_open(path, framework="flax") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - SafetensorError is not importable under a stable name
        raise ModelImportError(f"{path}: not a complete safetensors file ({e}); re-download or re-save it") from e


def check_checkpoint(model_dir: Path, cfg: ModelConfig) -> dict[str, Path]:
    """Compare a checkpoint's keys and shapes with ``cfg``; return ``{key: file}`` of what to read."""
    files = safetensors_files(model_dir)
    found: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        found.update({k: shape for k, (shape, _) in _header(path).items() if files.get(k) == path})
    want = expected_shapes(cfg)
    if cfg.tie_embeddings and "lm_head.weight" in found:  # a tied head saved anyway: the embedding wins
        del found["lm_head.weight"]
    problems = [f"missing tensor {k} (shape {list(want[k])})" for k in want if k not in found]
    problems += [f"unexpected tensor {k} (shape {list(found[k])})" for k in found if k not in want]
    problems += [
        f"tensor {k} has shape {list(found[k])}, config.json implies {list(want[k])}"
        for k in want
        if k in found and found[k] != want[k]
    ]
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ModelImportError(f"{model_dir}: checkpoint does not match config.json:\n  " + "\n  ".join(problems[:10]) + more)
    return {k: files[k] for k in want}


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def _offsets(path: Path) -> tuple[int, dict[str, Any]]:
    """(start of the data section, header entries) of a safetensors file already checked by
    :func:`_header` (which parses it with ``safetensors`` and rejects truncated files)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def _read_tensor(path: Path, key: str, start: int, entry: dict[str, Any]) -> np.ndarray:
    """One tensor as a numpy array, read with plain file I/O into a single buffer.

    Not ``safe_open(...).get_tensor``: its flax path holds several transient copies and leaves the
    file's pages mapped, which more than doubled peak RSS on a 1 GB checkpoint (bench/hf_load.py).
    """
    if entry["dtype"] not in _DTYPES:
        raise ModelImportError(f"{path}: tensor {key} has dtype {entry['dtype']}; expected one of {sorted(_DTYPES)}")
    begin, end = entry["data_offsets"]
    buf = np.empty(end - begin, np.uint8)
    with open(path, "rb") as f:
        f.seek(start + begin)
        if f.readinto(memoryview(buf)) != end - begin:
            raise ModelImportError(f"{path}: tensor {key} is cut short; re-download or re-save the file")
    return buf.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def load_hf_params(model_dir: str | Path, cfg: ModelConfig) -> Params:
    """Read a Hugging Face checkpoint into needle's parameter tree (checkpoint dtypes kept)."""
    model_dir = Path(model_dir)
    plan = check_checkpoint(model_dir, cfg)
    keys, shapes = hf_key_map(cfg), expected_shapes(cfg)
    headers = {path: _offsets(path) for path in set(plan.values())}
    flat: dict[tuple[str, ...], jax.Array] = {}
    # Largest first: a tensor's transient host copies then overlap with few loaded params, so
    # the peak stays near one copy of the model (device_put copies; the host buffer is freed).
    for key in sorted(plan, key=lambda k: -math.prod(shapes[k])):
        start, entries = headers[plan[key]]
        host = _read_tensor(plan[key], key, start, entries[key])
        needle_path, transposed = keys[key]
        flat[needle_path] = jax.device_put(np.ascontiguousarray(host.T) if transposed else host)
        del host
    return traverse_util.unflatten_dict(flat)


def params_to_hf_tensors(params: Params, cfg: ModelConfig, dtype: Any = None) -> dict[str, jax.Array]:
    """Needle params -> ``{hf_key: tensor}`` in the HF layout, cast to ``dtype`` (None: as stored)."""
    flat = traverse_util.flatten_dict(params)
    keys = hf_key_map(cfg)
    missing = sorted("/".join(p) for p, _ in keys.values() if p not in flat)
    extra = sorted("/".join(p) for p in flat.keys() - {p for p, _ in keys.values()})
    if missing or extra:
        raise ModelImportError(
            f"params do not match the config: missing {missing[:5]}, unexpected {extra[:5]}"
            + (" (LoRA leaves: merge_lora first)" if any(p.endswith(("lora_a", "lora_b")) for p in extra) else "")
        )
    out = {}
    for key, (path, transposed) in keys.items():
        x = jnp.asarray(flat[path])
        x = x.T if transposed else x
        out[key] = x if dtype is None else x.astype(dtype)
    return out


def checkpoint_n_params(cfg: ModelConfig) -> int:
    """Parameter count of a checkpoint of ``cfg`` (tied head counted once)."""
    return sum(math.prod(s) for s in expected_shapes(cfg).values())
