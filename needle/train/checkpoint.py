"""Training checkpoints with orbax: save every N steps, keep the last few, resume exactly.

A checkpoint holds what a step changes (trainable params, optimizer state, step, RNG) plus a
JSON ``meta`` record: the data fingerprint, the configs and the tokenizer hash that must match
for a resume to be exact, and the shuffle position (= the step; ``BatchPlan.batch`` is a pure
function of it). Frozen params (a LoRA base) are not saved: they come from the base model.
Orbax writes each step to a temporary directory and renames it, so a crash (even SIGKILL)
leaves either a whole checkpoint or none. No pickle: arrays via orbax, meta as JSON.

    ckpt = Checkpointer(out_dir / "checkpoints", keep=2)
    ckpt.save(state, meta)                       # meta: build_meta(...)
    restored = ckpt.restore_latest(template_state, meta)   # None if there is none
    ckpt.close()                                 # waits for pending writes
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from needle.config import flatten_config
from needle.errors import CheckpointMismatchError
from needle.train.step import TrainState

log = logging.getLogger(__name__)

# Meta keys that describe where a checkpoint is, not what produced it: never compared.
RUNTIME_KEYS = frozenset({"step", "shuffle_position", "tokenizer_path"})


def build_meta(
    *,
    fingerprint: str,
    configs: dict[str, Any],
    tokenizer_sha256: str | None = None,
    tokenizer_path: str | None = None,
) -> dict[str, Any]:
    """The JSON record a resume must match: data fingerprint, flattened configs, tokenizer hash.

    ``configs`` maps a name (``model``, ``train``, ``optim``, ``lora``) to a pydantic config, a
    dict, or None; pass only the fields that change the trajectory (not hook cadences).
    """
    meta: dict[str, Any] = {"fingerprint": fingerprint, "tokenizer_sha256": tokenizer_sha256}
    for name, cfg in configs.items():
        meta[name] = None if cfg is None else flatten_config(cfg)
    if tokenizer_path is not None:
        meta["tokenizer_path"] = tokenizer_path
    return meta


def diff_meta(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two meta records (runtime keys ignored)."""
    a = flatten_config({k: v for k, v in expected.items() if k not in RUNTIME_KEYS})
    b = flatten_config({k: v for k, v in found.items() if k not in RUNTIME_KEYS})
    # JSON turns tuples into lists; compare in that form.
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    return sorted(k for k in a.keys() | b.keys() if norm(a.get(k)) != norm(b.get(k)))


def _saved_tree(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "trainable": state.trainable, "opt_state": state.opt_state, "rng": state.rng}


class Checkpointer:
    """An orbax ``CheckpointManager`` keeping the last ``keep`` steps under ``directory``."""

    def __init__(self, directory: str | Path, *, keep: int = 2) -> None:
        self.directory = Path(directory).absolute()
        # A SIGKILL mid-write leaves a temporary directory behind: clear it on the next start.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint kept on disk."""
        return sorted(self._mngr.all_steps())

    def save(self, state: TrainState, meta: dict[str, Any], *, step: int | None = None) -> bool:
        """Save ``state`` at its step (asynchronously; ``wait``/``close`` to be sure it is on disk).

        Returns False when a checkpoint of that step already exists (nothing is written).
        """
        step = int(jax.device_get(state.step)) if step is None else step
        if step in self._mngr.all_steps():
            return False
        record = {**meta, "step": step, "shuffle_position": step}
        # Orbax keeps zero-copy host views of CPU arrays while it writes in the background;
        # those views would stop the loop's next step from reusing (donating) these buffers.
        # Hand orbax a private copy so the live state stays donatable and the file is this step.
        tree = jax.tree.map(jnp.copy, _saved_tree(state))
        args = ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(record))
        saved = self._mngr.save(step, args=args, force=True)
        log.debug("checkpoint step %d -> %s", step, self.directory)
        return bool(saved)

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON meta record of a saved step."""
        return dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def restore_latest(
        self, template: TrainState, expected_meta: dict[str, Any]
    ) -> tuple[TrainState, dict[str, Any]] | None:
        """Restore the newest checkpoint into ``template``'s structure and shardings.

        Returns ``(state, meta)``, or None when there is no checkpoint. Raises
        ``CheckpointMismatchError`` naming the differing keys if the checkpoint was written
        for another config, dataset or tokenizer.
        """
        step = self.latest_step()
        if step is None:
            return None
        meta = self.read_meta(step)
        differing = diff_meta(expected_meta, meta)
        if differing:
            detail = ", ".join(f"{k}: saved {_lookup(meta, k)!r} != now {_lookup(expected_meta, k)!r}" for k in differing[:8])
            raise CheckpointMismatchError(
                f"checkpoint {self.directory}/{step} was written for a different run ({detail}); "
                "use a fresh out_dir or delete the checkpoints to start over"
            )
        tree = _saved_tree(template)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        saved = self._mngr.restore(step, args=args)["state"]
        if jax.tree.structure(saved) != jax.tree.structure(tree):
            raise CheckpointMismatchError(
                f"checkpoint {self.directory}/{step} holds a different parameter or optimizer tree"
            )
        state = template.replace(
            step=saved["step"], trainable=saved["trainable"], opt_state=saved["opt_state"], rng=saved["rng"]
        )
        log.info("resumed from checkpoint step %d in %s", step, self.directory)
        return state, meta

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self._mngr.wait_until_finished()
        self._mngr.close()


def _lookup(meta: dict[str, Any], dotted: str) -> Any:
    return flatten_config({k: v for k, v in meta.items() if k not in RUNTIME_KEYS}).get(dotted)
