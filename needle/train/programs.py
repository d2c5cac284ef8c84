"""Compiled train/eval steps kept on disk as executables, so a warm start skips tracing too.

JAX's persistent compilation cache (``needle.hardware.enable_compilation_cache``) skips XLA's
compile, but a process still traces the step and lowers it to look the cache up: for needle's
small models that is most of a cold first step. Here the compiled executable itself is
serialised (``jax.experimental.serialize_executable``, the JAX-supported way to save a compiled
program) under ``<cache_dir>/executables/<key>.pkl``, and a later process with the same key
loads it without tracing. The key covers everything that decides the program: the step
function, the model and optimizer (the state's static fields, by value), the state's and the
batch's tree, shapes, dtypes and shardings, the JAX/jaxlib/flax/optax versions, the devices,
``XLA_FLAGS``, and the source of the ``needle`` package (any code change is a new key). A file
that fails to load is compiled again and overwritten.

Not used by the training loop: on the CPU backend an executable saved by one process and
loaded in another failed at its first run ("NOT_FOUND: Function bitcast_copy_fusion.1 not
found"), an error no load-time check catches. Without ``cache_dir`` this is a plain
once-per-signature compile, which the loop uses.

    step = StepPrograms(train_step, donate=True, cache_dir=".cache/jax")
    state, metrics = step(state, batch)          # compiled (or loaded) once per batch signature
    step.stats                                   # {"compiled": 1, "loaded": 0, ...}
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

log = logging.getLogger(__name__)
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
    """``fn(state, batch)`` jitted, compiled once per batch signature, saved and loaded as an
    executable. One instance serves one state layout (one ``train`` call)."""

    def __init__(self, fn: Callable[..., Any], *, donate: bool, cache_dir: str | None) -> None:
        self._fn = fn
        self._jitted = jax.jit(fn, donate_argnums=0) if donate else jax.jit(fn)
        self._dir = Path(cache_dir) / "executables" if cache_dir else None
        self._programs: dict[Any, Any] = {}
        self.stats = {"compiled": 0, "loaded": 0, "reused": 0}

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
        _MEMORY[key] = program = self._load_or_compile(key, state, batch)
        return program

    def _load_or_compile(self, key: str, state: Any, batch: Any) -> Any:
        if self._dir is None:
            self.stats["compiled"] += 1
            return self._jitted.lower(state, batch).compile()
        from jax.experimental import serialize_executable

        path = self._dir / f"{key}.pkl"
        if path.exists():
            try:
                program = serialize_executable.deserialize_and_load(*pickle.loads(path.read_bytes()))
                self.stats["loaded"] += 1
                return program
            except Exception as err:  # a damaged or incompatible file: compile again
                log.warning("could not load the compiled %s from %s (%s); compiling again", self._fn.__name__, path, err)
        program = self._jitted.lower(state, batch).compile()
        self.stats["compiled"] += 1
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            tmp.write_bytes(pickle.dumps(serialize_executable.serialize(program)))
            tmp.replace(path)
        except Exception as err:  # a read-only cache or an unserialisable program: run without saving
            log.warning("could not save the compiled %s to %s: %s", self._fn.__name__, path, err)
        return program
