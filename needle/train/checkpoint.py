"""Training checkpoints with orbax: save every N steps, keep the last few, resume exactly.

A checkpoint holds what a step changes (trainable params, optimizer state, step, RNG) plus a
JSON ``meta`` record: the data fingerprint, the configs and the tokenizer hash that must match
for a resume to be exact, and the shuffle position (= the step; ``BatchPlan.batch`` is a pure
function of it). Frozen params (a LoRA base) are not saved: they come from the base model.
Orbax writes each step to a temporary directory and renames it, so a crash (even SIGKILL)
leaves either a whole checkpoint or none. No pickle: arrays via orbax, meta as JSON.

Each checkpoint also holds ``needle_checksums.json``: the sha256 of every file it wrote, recorded
in orbax's temporary directory after the write finishes and before the rename, so it appears
with the checkpoint or not at all. ``restore_latest`` verifies it, restores, and checks that
every value is finite; a damaged newest checkpoint is reported in one log line, moved to
``<directory>.damaged/`` and the next older one is tried. When every checkpoint is damaged it
raises ``CheckpointDamagedError`` saying why each one failed.

    ckpt = Checkpointer(out_dir / "checkpoints", keep=2)
    ckpt.save(state, meta)                       # meta: build_meta(...)
    restored = ckpt.restore_latest(template_state, meta)   # None if there is none
    ckpt.close()                                 # waits for pending writes
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from needle.config import flatten_config
from needle.errors import CheckpointDamagedError, CheckpointMismatchError
from needle.model.decoder.scan import LAYERS, map_param_trees, stack_layers, unstack_layers
from needle.train.step import TrainState, tree_all_finite

log = logging.getLogger(__name__)

# Meta keys that describe where a checkpoint is, not what produced it: never compared.
RUNTIME_KEYS = frozenset({"step", "shuffle_position", "tokenizer_path"})
# Config keys a resume may change (with a warning): they shape the schedule, not the saved state.
# train.fsdp is the layout over devices: a checkpoint restores into any layout (and process count).
RESUMABLE_CHANGES = frozenset({"optim.lr", "optim.min_lr_ratio", "train.fsdp"})

CHECKSUM_FILE = "needle_checksums.json"
# Not content: orbax's commit markers and step metadata hold timestamps and may be rewritten
# when the checkpoint is finalised, after the checksums are recorded.
_UNHASHED = frozenset({CHECKSUM_FILE, CHECKSUM_FILE + ".partial", "_CHECKPOINT_METADATA", "commit_success.txt"})
_ORBAX_TMP = ".orbax-checkpoint-tmp"


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(step_dir: Path) -> None:
    """Record the sha256 of every content file under ``step_dir`` in ``CHECKSUM_FILE`` (atomically)."""
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name not in _UNHASHED)
    record = {"algorithm": "sha256", "files": {p.relative_to(step_dir).as_posix(): _sha256(p) for p in files}}
    partial = step_dir / (CHECKSUM_FILE + ".partial")
    partial.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(partial, step_dir / CHECKSUM_FILE)


def verify_checksums(step_dir: Path) -> bool:
    """True when every recorded file matches; False when there is no record (an older checkpoint).

    Raises ``CheckpointDamagedError`` naming the first missing or changed file.
    """
    if not step_dir.is_dir():
        raise CheckpointDamagedError(f"{step_dir} is not a folder")
    path = step_dir / CHECKSUM_FILE
    if not path.exists():
        return False
    try:
        files = json.loads(path.read_text())["files"]
        items = sorted(files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointDamagedError(f"{CHECKSUM_FILE} is unreadable ({err})") from None
    if not items:
        raise CheckpointDamagedError(f"{CHECKSUM_FILE} lists no files")
    for rel, expected in items:
        file = step_dir / rel
        if not file.is_file():
            raise CheckpointDamagedError(f"{rel} is missing")
        if _sha256(file) != expected:
            raise CheckpointDamagedError(f"{rel} does not match its recorded sha256")
    return True


def _one_line(err: BaseException) -> str:
    """An exception as one short line (orbax/tensorstore messages run over many)."""
    text = " ".join(str(err).split())
    text = text if isinstance(err, CheckpointDamagedError) else f"{type(err).__name__}: {text}"
    return text if len(text) <= 240 else text[:237] + "..."


def _saved_tree(state: TrainState) -> dict[str, Any]:
    """What a checkpoint holds, blocks in the ``block_i`` layout (a scanned state's stacked
    ``layers`` are unstacked: one format whichever way the layers run)."""
    trainable, opt_state = unstack_layers(state.trainable), map_param_trees(unstack_layers, state.opt_state, state.trainable)
    return {"step": state.step, "trainable": trainable, "opt_state": opt_state, "rng": state.rng}


def _restacked(saved: dict[str, Any], template: TrainState) -> dict[str, Any]:
    """``saved`` (block_i layout) with its blocks stacked as ``template``'s are, if they are."""
    if not isinstance(template.trainable, dict) or LAYERS not in template.trainable:
        return saved
    period = len(template.trainable[LAYERS])
    stack = lambda t: stack_layers(t, period)  # noqa: E731
    return {**saved, "trainable": stack(saved["trainable"]),
            "opt_state": map_param_trees(stack, saved["opt_state"], saved["trainable"])}  # fmt: skip


class Checkpointer:
    """An orbax ``CheckpointManager`` keeping the last ``keep`` steps under ``directory``."""

    def __init__(self, directory: str | Path, *, keep: int = 2) -> None:
        self.directory = Path(directory).absolute()
        self._in_flight: int | None = None  # the step being written (orbax writes one at a time)
        # A SIGKILL mid-write leaves a temporary directory behind: clear it on the next start.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal),
        )  # fmt: skip
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def _seal(self) -> None:
        """Orbax's post-finalisation callback: checksum the written files before the final rename."""
        step = self._in_flight
        if step is None:
            return
        tmp = sorted(self.directory.glob(f"{step}{_ORBAX_TMP}*"))
        write_checksums(tmp[-1] if tmp else self.directory / str(step))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint kept on disk."""
        return sorted(self._mngr.all_steps())

    def save(self, state: TrainState, meta: dict[str, Any], *, step: int | None = None) -> bool:
        """Save ``state`` at its step (asynchronously; ``wait``/``close`` to be sure it is on disk).

        Returns False when a checkpoint of that step already exists (nothing is written). The
        caller makes sure ``state`` is finite (the loop checks every step's ``finite`` flag).
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
        self._mngr.wait_until_finished()  # orbax waits too; the previous step's seal must be done
        self._in_flight = step
        saved = self._mngr.save(step, args=args, force=True)
        log.debug("checkpoint step %d -> %s", step, self.directory)
        return bool(saved)

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON meta record of a saved step."""
        return dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def restore_latest(
        self, template: TrainState, expected_meta: dict[str, Any]
    ) -> tuple[TrainState, dict[str, Any]] | None:
        """Restore the newest usable checkpoint into ``template``'s structure and shardings.

        Returns ``(state, meta)``, or None when there is no checkpoint. A damaged checkpoint
        (unreadable, failing its checksum, holding NaN/inf) is skipped for the next older one,
        and moved aside once one restores; ``CheckpointDamagedError`` when none is usable.
        Raises ``CheckpointMismatchError`` naming the differing keys if a readable checkpoint
        was written for another config, dataset or tokenizer.
        """
        self._mngr.wait_until_finished()  # a save of this manager may still be in flight
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            try:
                state, meta = self._restore_step(step, template, expected_meta)
            except CheckpointMismatchError:
                raise
            except Exception as err:  # noqa: BLE001 - any failure to read a checkpoint is damage
                damaged.append((step, _one_line(err)))
                continue
            self._set_aside(damaged, step)
            log.info("resumed from checkpoint step %d in %s", step, self.directory)
            return state, meta
        if damaged:
            reasons = "; ".join(f"step {s}: {why}" for s, why in damaged)
            raise CheckpointDamagedError(
                f"no usable checkpoint in {self.directory} ({reasons}); "
                "delete that folder (or use a fresh out_dir) to start over"
            )
        return None

    def _restore_step(
        self, step: int, template: TrainState, expected_meta: dict[str, Any]
    ) -> tuple[TrainState, dict[str, Any]]:
        """Verify, read and restore one step; raises on any damage or on a mismatching record."""
        verified = verify_checksums(self.directory / str(step))
        meta = self.read_meta(step)
        differing = diff_meta(expected_meta, meta)
        changed = [k for k in differing if k in RESUMABLE_CHANGES]
        differing = [k for k in differing if k not in RESUMABLE_CHANGES]
        if changed and not differing:
            # The learning rate lives in the schedule, not in the saved state: lowering it to
            # continue past a divergence is a deliberate change of course, said once.
            log.warning("resuming step %d with %s", step,
                        ", ".join(f"{k} changed from {_lookup(meta, k)!r} to {_lookup(expected_meta, k)!r}" for k in changed))
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
        if not bool(tree_all_finite(saved)):
            raise CheckpointDamagedError("it holds NaN or infinite values")
        if not verified:
            log.warning("checkpoint step %d in %s has no %s (an older needle wrote it): restored unverified",
                        step, self.directory, CHECKSUM_FILE)  # fmt: skip
        saved = _restacked(saved, template)
        state = template.replace(
            step=saved["step"], trainable=saved["trainable"], opt_state=saved["opt_state"], rng=saved["rng"]
        )
        return state, meta

    def _set_aside(self, damaged: list[tuple[int, str]], good: int) -> None:
        """Move damaged checkpoints newer than ``good`` to ``<directory>.damaged/`` (one line each).

        Out of the way, the resumed run writes those steps again.
        """
        if not damaged:
            return
        aside = self.directory.with_name(self.directory.name + ".damaged")
        for step, why in damaged:
            target = aside / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}"
            source = self.directory / str(step)
            if source.exists():
                aside.mkdir(parents=True, exist_ok=True)
                shutil.move(str(source), str(target))
            log.warning("checkpoint step %d in %s is damaged (%s): moved to %s, falling back to step %d",
                        step, self.directory, why, target, good)  # fmt: skip
        self._mngr.reload()

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self._mngr.wait_until_finished()
        self._mngr.close()


def _lookup(meta: dict[str, Any], dotted: str) -> Any:
    return flatten_config({k: v for k, v in meta.items() if k not in RUNTIME_KEYS}).get(dotted)
