"""Parameter-tree utilities for LoRA and full fine-tuning: init, split/combine, merge, attach.

Trees are the nested dicts of ``Transformer`` (see needle/model/decoder/transformer.py); LoRA leaves are
the ``lora_a``/``lora_b`` siblings of a projection's ``kernel``.

    params = init_params(cfg, lora, jax.random.key(0))
    params = attach_base(params, base_params)                # base weights under fresh adapters
    trainable, frozen = split_trainable(params, "lora")      # optimise only the adapters
    merged = merge_lora(combine(trainable, frozen), lora)    # W + scale·A·B, base layout, for export
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import traverse_util

from needle.config import LoraConfig, ModelConfig
from needle.errors import CheckpointMismatchError
from needle.hardware import BackendSettings
from needle.model.factory import module_for
from needle.model.decoder.scan import cast_matrices

Params = dict[str, Any]
LORA_LEAVES = frozenset({"lora_a", "lora_b"})
TrainMode = Literal["lora", "full", "scratch"]


def _flat(tree: Params) -> dict[tuple[str, ...], Any]:
    return traverse_util.flatten_dict(tree) if tree else {}


def _unflat(flat: dict[tuple[str, ...], Any]) -> Params:
    return traverse_util.unflatten_dict(flat) if flat else {}


def _is_lora(path: tuple[str, ...]) -> bool:
    return path[-1] in LORA_LEAVES


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path)


# From this depth the whole init runs op by op instead of as one jitted program: XLA compiles one
# random generator per leaf into that program (the 135M Llama shape, 30 layers and LoRA: 73 s on
# the 2-core CPU, over 100 s on a TPU v5e), while op by op compiles one per distinct shape (11 s
# cold, 3.6 s warm). The values agree to float rounding (1.5e-8), not bit for bit, so shallower
# models (the tiny, small and medium presets, the tests' models) keep the jitted program and
# their exact values; needle-45m (12 layers) and the real shapes initialise op by op.
EAGER_INIT_MIN_LAYERS = 8


def init_params(
    cfg: ModelConfig, lora: LoraConfig | None, rng: jax.Array | int, settings: BackendSettings | None = None
) -> Params:
    """Initialise the model's parameters (with adapters when ``lora`` is given): under jit, or op
    by op for a model of ``EAGER_INIT_MIN_LAYERS`` layers or more."""
    init, key = _initializer(cfg, lora, rng, settings)
    return init(key) if cfg.n_layers >= EAGER_INIT_MIN_LAYERS else jax.jit(init)(key)


def init_adapters(cfg: ModelConfig, lora: LoraConfig, rng: jax.Array | int, settings: BackendSettings | None = None) -> Params:
    """:func:`init_params`' tree with only the adapter leaves computed, the base leaves as
    ``jax.ShapeDtypeStruct``: for a base whose weights replace them (:func:`attach_base`). The
    adapters are init_params' own: bit for bit below ``EAGER_INIT_MIN_LAYERS``, to float rounding
    from there (init_params runs op by op there, this stays one jitted program).

    Compiling only the adapters' initialisers is what makes this cheap: the 135M Llama shape's
    whole init program compiled for 83 s on the 2-core CPU, the adapters' alone 21 s (2026-12-06).
    Op by op it would build the whole frozen base in float32 first."""
    init, key = _initializer(cfg, lora, rng, settings)
    adapters = jax.jit(lambda k: split_trainable(init(k), "lora")[0])(key)
    return combine(adapters, split_trainable(jax.eval_shape(init, key), "lora")[1])


def _initializer(
    cfg: ModelConfig, lora: LoraConfig | None, rng: jax.Array | int, settings: BackendSettings | None
) -> tuple[Any, jax.Array]:
    """``(key -> params, key)`` of ``cfg``'s module, initialised on a short dummy sequence."""
    model = module_for(cfg, lora, settings)
    tokens = jnp.zeros((1, min(8, cfg.max_len)), jnp.int32)
    return (lambda key: model.init(key, tokens)["params"]), (jax.random.key(rng) if isinstance(rng, int) else rng)


def split_trainable(params: Params, mode: TrainMode) -> tuple[Params, Params]:
    """Split into ``(trainable, frozen)``: ``lora`` trains only adapter leaves, else everything."""
    if mode in ("full", "scratch"):
        return params, {}
    if mode != "lora":
        raise ValueError(f"unknown training mode {mode!r}; choose 'lora', 'full' or 'scratch'")
    flat = _flat(params)
    trainable = {k: v for k, v in flat.items() if _is_lora(k)}
    if not trainable:
        raise ValueError("mode 'lora' but the params have no lora_a/lora_b leaves: build them with a LoraConfig")
    frozen = {k: v for k, v in flat.items() if not _is_lora(k)}
    return _unflat(trainable), _unflat(frozen)


def in_compute_dtype(params: Params, settings: BackendSettings | None) -> Params:
    """``params`` with its matrices in the compute dtype (vectors: norm scales, biases, as stored).

    On accelerators the compute dtype is bfloat16 and every projection casts its kernel to it
    before use, so a frozen LoRA base or decoding weights held in bfloat16 compute the same in
    half the memory and half the bytes read a step (Qwen3-0.6B: 1.2 GB instead of 2.4 GB). Where
    compute and master dtypes agree (the CPU) the tree is returned as it is."""
    if settings is None or jnp.dtype(settings.compute_dtype) == jnp.dtype(settings.param_dtype):
        return params
    return cast_matrices(params, jnp.dtype(settings.compute_dtype))


def combine(trainable: Params, frozen: Params) -> Params:
    """Inverse of :func:`split_trainable`: one tree holding both halves."""
    flat_t, flat_f = _flat(trainable), _flat(frozen)
    overlap = sorted(_name(k) for k in flat_t.keys() & flat_f.keys())
    if overlap:
        raise ValueError(f"combine: {len(overlap)} leaves are in both halves, e.g. {overlap[:3]}")
    return _unflat({**flat_f, **flat_t})


def merge_lora(params: Params, lora: LoraConfig) -> Params:
    """Fold each adapter into its kernel (``W + scale·A·B``) and drop the LoRA leaves."""
    flat = _flat(params)
    merged = {k: v for k, v in flat.items() if not _is_lora(k)}
    for path in [k for k in flat if k[-1] == "lora_a"]:
        module = path[:-1]
        kernel_key, b_key = module + ("kernel",), module + ("lora_b",)
        if kernel_key not in flat or b_key not in flat:
            raise ValueError(f"merge_lora: {_name(module)} has lora_a but lacks kernel or lora_b")
        a, b, kernel = flat[path], flat[b_key], flat[kernel_key]
        if a.shape[-1] != lora.rank:
            raise ValueError(
                f"merge_lora: {_name(module)} has rank {a.shape[-1]} adapters but LoraConfig.rank={lora.rank}"
            )
        delta = jnp.matmul(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
        merged[kernel_key] = (jnp.asarray(kernel, jnp.float32) + lora.scale * delta).astype(kernel.dtype)
    orphans = [k for k in flat if k[-1] == "lora_b" and k[:-1] + ("lora_a",) not in flat]
    if orphans:
        raise ValueError(f"merge_lora: lora_b without lora_a at {[_name(k[:-1]) for k in orphans]}")
    return _unflat(merged)


def attach_base(lora_params: Params, base_params: Params) -> Params:
    """Replace every non-LoRA leaf of ``lora_params`` by the base's weight of the same name."""
    flat_l, flat_b = _flat(lora_params), _flat(base_params)
    problems: list[str] = []
    base_lora = [_name(k) for k in flat_b if _is_lora(k)]
    if base_lora:
        problems.append(f"base has LoRA leaves (merge_lora it first), e.g. {base_lora[:3]}")
    wanted = {k: v for k, v in flat_l.items() if not _is_lora(k)}
    missing = sorted(_name(k) for k in wanted.keys() - flat_b.keys())
    extra = sorted(_name(k) for k in flat_b.keys() - flat_l.keys())
    if missing:
        problems.append(f"base lacks {len(missing)} weights, e.g. {missing[:3]}")
    if extra:
        problems.append(f"base has {len(extra)} weights the model does not, e.g. {extra[:3]}")
    for k in sorted(wanted.keys() & flat_b.keys()):
        if tuple(flat_b[k].shape) != tuple(wanted[k].shape):
            problems.append(f"{_name(k)}: base shape {tuple(flat_b[k].shape)} != model shape {tuple(wanted[k].shape)}")
    if problems:
        raise CheckpointMismatchError("base params do not fit this model config:\n  " + "\n  ".join(problems))
    out = dict(flat_l)
    for k, v in wanted.items():
        out[k] = jnp.asarray(flat_b[k], dtype=v.dtype)
    return _unflat(out)


def count_params(tree: Any) -> int:
    """Number of scalars in a tree of arrays (or ``jax.ShapeDtypeStruct``s)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
