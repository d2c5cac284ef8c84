"""Data parallelism over all local devices with ``jax.sharding``.

A 1-D mesh with axis ``"data"``: batches are split along their leading axis, the train state
is replicated, and XLA inserts the gradient all-reduce when it compiles ``train_step``. On one
device this is a no-op layout, so the loop uses the same code everywhere.

    mesh = make_mesh()
    state = replicate(state, mesh)
    batch = shard_batch(plan.batch(step), mesh)

Try 8 fake CPU devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def make_mesh(devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D ``"data"`` mesh over the given devices (default: every local device)."""
    devs = list(devices) if devices is not None else jax.local_devices()
    if not devs:
        raise ValueError("make_mesh: no devices")
    return Mesh(np.array(devs), (DATA_AXIS,))


def data_size(mesh: Mesh) -> int:
    """How many ways the batch is split."""
    return int(mesh.shape[DATA_AXIS])


def shard_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Put each array on the mesh split along its leading (batch) axis."""
    n = data_size(mesh)
    sharding = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
    out = {}
    for name, value in batch.items():
        rows = np.shape(value)[0] if np.ndim(value) else None
        if rows is None or rows % n:
            raise ValueError(
                f"shard_batch: batch[{name!r}] has leading size {rows}, which does not divide "
                f"across {n} devices; make batch_size a multiple of the device count"
            )
        out[name] = jax.device_put(value, sharding)
    return out


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Put a copy of every array of ``tree`` on each device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))
