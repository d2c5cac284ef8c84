"""Data parallelism and sharded parameters over all local devices with ``jax.sharding``.

A 2-D mesh with axes ``"data"`` and ``"fsdp"`` (``TrainConfig.fsdp`` devices on the second, the
rest on the first; the default ``fsdp=1`` is plain data parallelism). Batches are split along
their leading axis over every device (both axes). The frozen base and, in full fine-tuning,
the trained parameters and their optimizer state are sharded over ``fsdp`` (each large leaf
split along its largest axis that divides; ``place_state``), so each device holds ``1/fsdp`` of
them; LoRA adapters and their optimizer state stay replicated. XLA inserts the all-gathers and
the gradient reduce-scatter when it compiles ``train_step``. On one device every layout is a
no-op, so the loop uses the same code everywhere.

    mesh = make_mesh(fsdp=4)
    state = place_state(state, mesh, shard_trainable=True)
    batch = shard_batch(plan.batch(step), mesh)

Try 8 fake CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
# Leaves smaller than this stay replicated: sharding a bias or a norm scale saves nothing and
# costs a collective.
MIN_SHARDED_SIZE = 1024


def make_mesh(devices: list[jax.Device] | None = None, fsdp: int = 1) -> Mesh:
    """A ``("data", "fsdp")`` mesh over the given devices (default: every device of every
    process), ``fsdp`` on the second axis."""
    devs = list(devices) if devices is not None else jax.devices()
    if not devs:
        raise ValueError("make_mesh: no devices")
    if fsdp < 1 or len(devs) % fsdp:
        raise ValueError(f"make_mesh: fsdp={fsdp} does not divide the {len(devs)} devices")
    return Mesh(np.array(devs).reshape(len(devs) // fsdp, fsdp), (DATA_AXIS, FSDP_AXIS))


def data_size(mesh: Mesh) -> int:
    """How many ways the batch is split (every device: both axes)."""
    return int(mesh.size)


def shard_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Put each array on the mesh split along its leading (batch) axis."""
    n = data_size(mesh)
    sharding = NamedSharding(mesh, PartitionSpec((DATA_AXIS, FSDP_AXIS)))
    out = {}
    for name, value in batch.items():
        rows = np.shape(value)[0] if np.ndim(value) else None
        if rows is None or rows % n:
            raise ValueError(
                f"shard_batch: batch[{name!r}] has leading size {rows}, which does not divide "
                f"across {n} devices; make batch_size a multiple of the device count"
            )
        out[name] = put(value, sharding)
    return out


def put(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` (the same global value in every process) laid out by ``sharding``.

    One process: ``jax.device_put``. Several: each process builds only the shards its own
    devices hold, from its copy of the value (``jax.make_array_from_callback``).
    """
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Put a copy of every array of ``tree`` on each device of the mesh."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: put(x, sharding), tree)


def fetch(tree: Any) -> Any:
    """Every array of ``tree`` as a whole numpy array in this process, gathered from the other
    processes' devices where it is sharded across them (every process must call it)."""
    from jax.experimental import multihost_utils

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(one, tree)


def fsdp_spec(shape: tuple[int, ...], n: int) -> PartitionSpec:
    """``fsdp`` on the largest axis of ``shape`` that ``n`` divides; replicated for small leaves or none."""
    if n == 1 or int(np.prod(shape, dtype=np.int64)) < MIN_SHARDED_SIZE:
        return PartitionSpec()
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[axis] % n == 0:
            return PartitionSpec(*(FSDP_AXIS if a == axis else None for a in range(len(shape))))
    return PartitionSpec()


def shard_fsdp(tree: Any, mesh: Mesh) -> Any:
    """Every array of ``tree`` placed by :func:`fsdp_spec` (the same shape, the same layout)."""
    n = int(mesh.shape[FSDP_AXIS])
    return jax.tree.map(lambda x: put(x, NamedSharding(mesh, fsdp_spec(np.shape(x), n))), tree)


def place_state(state: Any, mesh: Mesh, *, shard_trainable: bool) -> Any:
    """A ``TrainState`` on the mesh: frozen params sharded over ``fsdp``; the trained params and
    optimizer state too when ``shard_trainable`` (full fine-tuning), else replicated (LoRA)."""
    trained = shard_fsdp if shard_trainable else replicate
    return state.replace(
        step=replicate(state.step, mesh), rng=replicate(state.rng, mesh), frozen=shard_fsdp(state.frozen, mesh),
        trainable=trained(state.trainable, mesh), opt_state=trained(state.opt_state, mesh),
    )  # fmt: skip
