"""The train and eval steps compiled once per batch signature and reused within a process.

``StepPrograms`` jits a step (state donated for training), compiles it ahead of time for the
first batch of each signature, and keeps the executable in memory under a content key: the step
function, the model and optimizer (the state's static fields, by value), the state's and the
batch's tree, shapes, dtypes and shardings, the JAX/jaxlib/flax/optax versions, the devices,
``XLA_FLAGS`` and the source of the ``needle`` package. A second ``train`` call in the same
process with the same key (a resume, the next phase of the same shapes) reuses the program.
Across processes, JAX's persistent compilation cache (``needle.hardware.enable_compilation_cache``)
skips XLA's compile; tracing and lowering remain.

Compiled executables are not written to disk: serialising them
(``jax.experimental.serialize_executable``) goes through pickle, and on the CPU backend an
executable saved by one process failed at its first run in another ("NOT_FOUND: Function
bitcast_copy_fusion.1 not found"), an error no load-time check catches. Both reasons are why
the earlier on-disk variant was removed.

    step = StepPrograms(train_step, donate=True)
    state, metrics = step(state, batch)          # compiled once per batch signature
    step.stats                                   # {"compiled": 1, "reused": 0}
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

_PACKAGE = Path(__file__).resolve().parents[1]
_CODE_DIGEST: list[str] = []


def code_digest() -> str:
    """sha256 over the ``needle`` package's Python sources (computed once per process)."""
    if not _CODE_DIGEST:
        h = hashlib.sha256()
        for path in sorted(_PACKAGE.rglob("*.py")):
            h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
        _CODE_DIGEST.append(h.hexdigest())
    return _CODE_DIGEST[0]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _leaf_spec(x: Any) -> tuple[Any, ...]:
    sharding = getattr(x, "sharding", None)
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return (tuple(np.shape(x)), str(dtype), str(sharding) if sharding is not None else None)


def program_key(name: str, args: tuple[Any, ...]) -> str:
    """A content key of the program ``name`` compiled for ``args`` (see the module docstring)."""
    statics = [repr(jax.tree.structure(a)) for a in args]
    parts = {
        "name": name,
        "trees": statics,
        "leaves": [[_leaf_spec(x) for x in jax.tree.leaves(a)] for a in args],
        "versions": [_version(p) for p in ("jax", "jaxlib", "flax", "optax")],
        "devices": [(d.platform, d.device_kind) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "code": code_digest(),
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


# Programs compiled or loaded in this process, by key: a second run in the same process (a
# resume, the next phase of the same shapes) reuses them.
_MEMORY: dict[str, Any] = {}


class StepPrograms:
    """``fn(state, batch)`` jitted and compiled once per batch signature. One instance serves one
    state layout (one ``train`` call)."""

    def __init__(self, fn: Callable[..., Any], *, donate: bool) -> None:
        self._fn = fn
        self._jitted = jax.jit(fn, donate_argnums=0) if donate else jax.jit(fn)
        self._programs: dict[Any, Any] = {}
        self.stats = {"compiled": 0, "reused": 0}

    def __call__(self, state: Any, batch: Any) -> Any:
        # Shapes and dtypes only: one instance serves one train call, whose shardings are fixed.
        sig = tuple((k, np.shape(v), getattr(v, "dtype", None)) for k, v in batch.items())
        program = self._programs.get(sig)
        if program is None:
            program = self._programs[sig] = self._obtain(state, batch)
        return program(state, batch)

    def _obtain(self, state: Any, batch: Any) -> Any:
        name = self._fn.__name__
        key = f"{name}-{program_key(name, (state, batch))}"
        if key in _MEMORY:
            self.stats["reused"] += 1
            return _MEMORY[key]
        self.stats["compiled"] += 1
        _MEMORY[key] = program = self._jitted.lower(state, batch).compile()
        return program
