"""Child process for tests/train: multi-device losses and killable training runs.

    python tests/train/train_worker.py losses STEPS BATCH_SIZE          # prints JSON losses
    python tests/train/train_worker.py fsdp STEPS BATCH_SIZE FSDP MODE  # losses, shard shares, params.npz
    python tests/train/train_worker.py group COORD N RANK STEPS BATCH_SIZE FSDP MODE  # one of N processes
    python tests/train/train_worker.py finetune DATA_DIR TOK_DIR OUT_DIR STEPS SLEEP_S [COORD N RANK FSDP]

``losses`` trains the tiny model on every visible device (run it with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``). ``finetune`` calls ``run_training``
in scratch mode, sleeping ``SLEEP_S`` after each step so a test can SIGKILL it between saves.
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace
from pathlib import Path
from typing import Any

import jax
import numpy as np
from train_helpers import finetune_configs, make_plan, make_state, train_cfg

from needle.data.prepare import PreparedData
from needle.tokenizers.native import Tokenizer
from needle.train.distributed import ProcessGroup, initialize
from needle.train.run import run_training
from needle.train.loop import train
from needle.train.sharding import fetch, make_mesh, shard_batch


def run_losses(steps: int, batch_size: int, fsdp: int = 1, mode: str = "scratch") -> tuple[list[float], Any]:
    """Per-step losses and the final state of the tiny model over every local device, ``fsdp`` of
    them on the mesh's fsdp axis."""
    cfg = train_cfg(steps=steps, batch_size=batch_size, log_every=1, mode=mode, fsdp=fsdp)
    mesh = make_mesh(fsdp=fsdp)
    result = train(make_state(mode, steps=steps), make_plan(batch_size=batch_size), cfg, mesh=mesh, progress=False)
    return [record["loss"] for record in result.history], result.state


def collect_losses(steps: int, batch_size: int) -> list[float]:
    """Per-step losses of the tiny model data-parallel over every local device."""
    return run_losses(steps, batch_size)[0]


def flat_params(state: Any) -> dict[str, np.ndarray]:
    """The trained and frozen parameters by path, as host arrays."""
    leaves = jax.tree_util.tree_leaves_with_path({"trainable": state.trainable, "frozen": state.frozen})
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def shard_fractions(state: Any) -> dict[str, float]:
    """Per large parameter leaf: the share of its elements device 0 holds."""
    out = {}
    leaves = jax.tree_util.tree_leaves_with_path({"trainable": state.trainable, "frozen": state.frozen})
    for path, leaf in leaves:
        if leaf.size >= 1024:
            shard = next(s for s in leaf.addressable_shards if s.device == jax.local_devices()[0])
            out[jax.tree_util.keystr(path)] = shard.data.size / leaf.size
    return out


class SlowTracker:
    """Sleeps after every logged step: a window for the test's kill -9 between checkpoints."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        print(f"step {step}", flush=True)
        time.sleep(self.sleep_s)


def main(argv: list[str]) -> None:
    if argv[0] == "losses":
        losses = collect_losses(int(argv[1]), int(argv[2]))
        try:  # 4 rows cannot split over 8 devices: shard_batch must say so
            shard_batch({"inputs": np.zeros((4, 2), np.int32)}, make_mesh())
            rejected = None
        except ValueError as err:
            rejected = str(err)
        print(json.dumps({"devices": jax.device_count(), "losses": losses, "rejected": rejected}))
    elif argv[0] == "fsdp":  # fsdp STEPS BATCH FSDP MODE: losses, shard shares, params.npz in the cwd
        losses, state = run_losses(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
        np.savez("params.npz", **flat_params(state))
        print(json.dumps({"devices": jax.device_count(), "losses": losses, "shares": shard_fractions(state)}))
    elif argv[0] == "group":  # one process of N: the fsdp command's output, params.npz from process 0
        initialize(ProcessGroup(argv[1], int(argv[2]), int(argv[3])))
        losses, state = run_losses(*(int(a) for a in argv[4:7]), argv[7])
        shares = shard_fractions(state)
        params = fetch({"trainable": state.trainable, "frozen": state.frozen})
        if jax.process_index() == 0:
            np.savez("params.npz", **flat_params(SimpleNamespace(**params)))
        print(json.dumps({"devices": jax.device_count(), "process": jax.process_index(), "losses": losses,
                          "shares": shares}))  # fmt: skip
    elif argv[0] == "finetune":
        data_dir, tok_dir, out_dir, steps, sleep_s = argv[1:6]
        fsdp = 1
        if len(argv) > 6:  # one process of a group
            initialize(ProcessGroup(argv[6], int(argv[7]), int(argv[8])))
            fsdp = int(argv[9])
        model_cfg, train, optim = finetune_configs("scratch", steps=int(steps), fsdp=fsdp)
        run_training(
            PreparedData.load(data_dir), Tokenizer.load(tok_dir), model_cfg, train, optim,
            out_dir=Path(out_dir), tracker=SlowTracker(float(sleep_s)),  # type: ignore[arg-type]
        )  # fmt: skip
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
