"""Read and write cactus-needle 3.2.8's format-version-2 checkpoints (one ``.safetensors`` file).

Ported from cactus-needle 3.2.8 ``needle/model/checkpoints.py`` and ``run.load_checkpoint``
(Apache-2.0). The file holds every parameter under its ``/``-joined tree name
(``stack/layers/block/self_attn/q_proj/kernel``) and string metadata ``format_version`` ("2"),
``config`` (the ``TransformerConfig`` as JSON), ``step`` and ``run`` (JSON)::

    params, config, meta = read_needle3_checkpoint("needle3.safetensors")
    model_cfg = needle3_model_config(config)            # ModelConfig(arch="needle3", needle3=...)
    write_needle3_checkpoint("out.safetensors", params, config, step=100, run={"name": "tuned"})

Reading never unpickles: the file's first bytes are checked to be a safetensors header before
the library parses it, and every problem is a :class:`Needle3CheckpointError` (a
``ModelImportError``) naming the file and the reason. Like the reference's loader, ``mtp_*``
tensors (its multi-token-prediction training heads) are dropped and a config missing a later
field gets the value that means "off". The probe heads may be absent as a whole (a checkpoint
from ``SimpleAttentionNetwork.init`` has none); ``meta["heads"]`` says which.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from needle.config import ModelConfig, Needle3Config
from needle.errors import ModelImportError
from needle.model.needle3.architecture import Needle3Model, check_supported

FORMAT_VERSION = 2
HEAD_KEYS = ("embedding_head", "confidence_head", "router_head")
# run.load_checkpoint / TransformerConfig.from_saved: fields an older checkpoint may lack, and
# the value that reproduces its numerics.
_SAVED_DEFAULTS = {
    "qk_head_dim": 0, "v_head_dim": 0, "sliding_window": 0, "global_layers": (), "ladder_depths": (),
    "ladder_sample": False, "ladder_widths": (), "ladder_order": (), "engram_seed_heads": 0, "qkv_conv_taps": 0,
    "out_vocab": 0,
}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024


class Needle3CheckpointError(ModelImportError):
    """A Needle 3 checkpoint that cannot be used; the message names the file and why."""


def _fail(path: Any, reason: str) -> Needle3CheckpointError:
    return Needle3CheckpointError(f"{path}: {reason}")


def _sniff(path: Path) -> None:
    """Refuse anything but a complete safetensors file, from its bytes, before parsing it."""
    if not path.is_file():
        raise _fail(path, "no such checkpoint file")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(9)
        if head[:1] == b"\x80" or head[:2] == b"PK":
            kind = "a zip archive (torch.save?)" if head[:2] == b"PK" else "a Python pickle"
            raise _fail(path, f"is {kind}, not a safetensors file; pickles are never loaded (security)")
        if len(head) < 9:
            raise _fail(path, f"truncated: {size} bytes is no safetensors file")
        (n,) = struct.unpack("<Q", head[:8])
        if head[8:9] != b"{" or n > _MAX_HEADER:
            raise _fail(path, "not a safetensors file (no JSON header at the start)")
        if 8 + n > size:
            raise _fail(path, f"truncated: header of {n} bytes but the file has {size}")
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise _fail(path, f"damaged safetensors header: {e}") from e
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if ends and 8 + n + max(ends) > size:
        raise _fail(path, f"truncated: tensors need {8 + n + max(ends)} bytes, the file has {size}")


def _config(path: Path, metadata: dict[str, str]) -> dict[str, Any]:
    from pydantic import ValidationError

    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise _fail(path, f"not a format-v{FORMAT_VERSION} Needle 3 checkpoint "
                          f"(format_version={metadata.get('format_version')!r})")  # fmt: skip
    text = metadata.get("config")
    if not text:
        raise _fail(path, "has no 'config' metadata (the TransformerConfig JSON a Needle 3 checkpoint carries)")
    try:
        saved = json.loads(text)
    except ValueError as e:
        raise _fail(path, f"'config' metadata is not JSON: {e}") from e
    if not isinstance(saved, dict):
        raise _fail(path, "'config' metadata is not a JSON object")
    if "attn_dim" in saved and "qk_head_dim" not in saved:
        raise _fail(path, "is a Needle 2 checkpoint (config has attn_dim); needle reads Needle 3 (cactus-needle 3.x)")
    saved = {**_SAVED_DEFAULTS, **saved}
    try:
        cfg = Needle3Config(**saved)
        check_supported(cfg)
    except (ValidationError, ValueError) as e:
        raise _fail(path, f"unsupported Needle 3 config: {e}") from e
    return cfg.model_dump(mode="json")


def needle3_model_config(config: Any, max_len: int | None = None) -> Any:
    """A ``ModelConfig(arch="needle3")`` for a Needle3Config (or its dict); the generic fields mirror it."""
    n3 = config if isinstance(config, Needle3Config) else Needle3Config(**config)
    qk = n3.qk_head_dim or n3.d_model // n3.num_heads
    return ModelConfig(
        preset="needle3", arch="needle3", needle3=n3, vocab_size=n3.vocab_size, d_model=n3.d_model,
        n_layers=n3.num_layers, n_heads=n3.num_heads, n_kv_heads=n3.num_kv_heads, head_dim=qk,
        max_len=max_len or n3.max_seq_len, rope_theta=n3.rope_theta, tie_embeddings=True,
    )  # fmt: skip


def expected_shapes(config: dict[str, Any], heads: bool = True) -> dict[str, tuple[int, ...]]:
    """``/``-name -> shape of every parameter of a Needle 3 model with this config (no LoRA)."""
    flat = dict(_shapes(json.dumps(config, sort_keys=True)))
    return {k: v for k, v in flat.items() if heads or k.split("/", 1)[0] not in HEAD_KEYS}


@functools.lru_cache(maxsize=16)
def _shapes(config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    config = json.loads(config_json)
    import jax
    import jax.numpy as jnp

    model = Needle3Model(needle3_model_config(config))
    tree = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    return tuple(("/".join(str(p.key) for p in path), tuple(v.shape)) for path, v in jax.tree_util.tree_leaves_with_path(tree))


def _check_tensors(path: Path, flat: dict[str, np.ndarray], config: dict[str, Any]) -> bool:
    has_heads = any(k.split("/", 1)[0] in HEAD_KEYS for k in flat)
    want = expected_shapes(config, heads=has_heads)
    problems = []
    if any(k.split("/", 1)[0] == "ab_scales" for k in flat):
        problems.append("has ab_scales (AB-scaled quantisation), which needle does not support")
    missing = sorted(want.keys() - flat.keys())
    extra = sorted(flat.keys() - want.keys() - {k for k in flat if k.startswith("ab_scales")})
    if missing:
        problems.append(f"lacks {len(missing)} tensors the config needs, e.g. {missing[:4]}")
    if extra:
        problems.append(f"has {len(extra)} tensors the config does not have, e.g. {extra[:4]}")
    for k in sorted(want.keys() & flat.keys()):
        if tuple(flat[k].shape) != want[k]:
            problems.append(f"{k}: shape {tuple(flat[k].shape)}, the config needs {want[k]}")
    if problems:
        raise _fail(path, "tensors disagree with its config:\n  " + "\n  ".join(problems[:12]))
    return has_heads


def _contiguous(value: Any) -> np.ndarray:
    array = np.asarray(value)
    return np.ascontiguousarray(array) if array.ndim else array  # ascontiguousarray makes 0-d 1-d


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        parts = name.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict) or hasattr(value, "items"):
            flat.update(flatten(dict(value), name))
        else:
            flat[name] = value
    return flat


def read_needle3_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(params, config, meta)``: nested dict of numpy arrays (as stored), the Needle3Config
    fields as a JSON-ready dict, and ``{"format_version", "step", "run", "heads", "dropped"}``."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise _fail(path, "a Needle 3 checkpoint must be a .safetensors file (pickled checkpoints are refused)")
    _sniff(path)
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    try:
        with safe_open(str(path), framework="np") as handle:
            metadata = handle.metadata() or {}
        flat = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise _fail(path, f"unreadable safetensors file: {e}") from e
    config = _config(path, metadata)
    dropped = sorted(k for k in flat if k.startswith("mtp_"))
    flat = {k: v for k, v in flat.items() if not k.startswith("mtp_")}
    heads = _check_tensors(path, flat, config)
    try:
        run = json.loads(metadata["run"]) if metadata.get("run") else {}
    except ValueError:
        run = metadata.get("run")
    step = int(metadata["step"]) if metadata.get("step", "").strip().isdigit() else None
    meta = {"format_version": FORMAT_VERSION, "step": step, "run": run, "heads": heads, "dropped": dropped}
    return unflatten(flat), config, meta


def write_needle3_checkpoint(path: str | os.PathLike, params: dict[str, Any], config_dict: dict[str, Any],
                             step: int = 0, run: Any = "needle") -> Path:  # fmt: skip
    """Write ``params`` (no LoRA leaves: merge them first) as the reference's format-v2 file.

    The config is validated as a Needle3Config and the tensors against it (same checks as the
    reader); arrays are stored as they are (float32 for needle's master weights).
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise _fail(path, "a Needle 3 checkpoint must be written as a .safetensors file")
    from safetensors.numpy import save_file

    flat = {k: _contiguous(v) for k, v in flatten(params).items()}
    lora = sorted(k for k in flat if k.rsplit("/", 1)[-1] in ("lora_a", "lora_b"))
    if lora:
        raise _fail(path, f"params hold LoRA leaves (merge them into the kernels first), e.g. {lora[:3]}")
    config = _config(path, {"format_version": str(FORMAT_VERSION), "config": json.dumps(dict(config_dict), default=list)})
    _check_tensors(path, flat, config)
    metadata = {
        "format_version": str(FORMAT_VERSION),
        "config": json.dumps(config),
        "step": "" if step is None else str(int(step)),
        "run": json.dumps(run or {}, default=str),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(flat, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path
