"""Child process for tests/train: multi-device losses and killable training runs.

    python tests/train/train_worker.py losses STEPS BATCH_SIZE          # prints JSON losses
    python tests/train/train_worker.py finetune DATA_DIR TOK_DIR OUT_DIR STEPS SLEEP_S

``losses`` trains the tiny model on every visible device (run it with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``). ``finetune`` calls ``run_training``
in scratch mode, sleeping ``SLEEP_S`` after each step so a test can SIGKILL it between saves.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from train_helpers import finetune_configs, make_plan, make_state, train_cfg

from needle.data.prepare import PreparedData
from needle.tokenizer import Tokenizer
from needle.train.finetune import run_training
from needle.train.loop import train
from needle.train.sharding import make_mesh, shard_batch


def collect_losses(steps: int, batch_size: int) -> list[float]:
    """Per-step losses of the tiny model data-parallel over every local device."""
    cfg = train_cfg(steps=steps, batch_size=batch_size, log_every=1)
    result = train(make_state(steps=steps), make_plan(batch_size=batch_size), cfg, mesh=make_mesh(), progress=False)
    return [record["loss"] for record in result.history]


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
    elif argv[0] == "finetune":
        data_dir, tok_dir, out_dir, steps, sleep_s = argv[1:6]
        model_cfg, train, optim = finetune_configs("scratch", steps=int(steps))
        run_training(
            PreparedData.load(data_dir), Tokenizer.load(tok_dir), model_cfg, train, optim,
            out_dir=Path(out_dir), tracker=SlowTracker(float(sleep_s)),  # type: ignore[arg-type]
        )  # fmt: skip
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
