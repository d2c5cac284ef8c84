"""One process against two on this machine: the same fine-tune as one jax.distributed program.

Trains the ``small`` preset from scratch (every weight trained, so every step all-reduces a full
gradient) on the first rows of ``data/sample/base.jsonl``, once as one process and once as two
processes of one CPU device each, the same global batch, through the library's ``run_training``
(``needle/train/distributed.py``). Reports tokens/s of both (compilation excluded), their ratio,
and the communication share: the time of one all-reduce of a gradient's worth of float32 between
the two processes, measured in the same program after training, over the step time.

    python -m bench.processes --out bench/results/processes.json     # about 3 minutes on 2 cores
    python -m bench.processes worker COORD N RANK SPEC.json OUT.json # one process (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from needle import pipeline
from needle.config import DataConfig, OptimConfig, TrainConfig, model_preset
from needle.data.prepare import load_cached, save_cached
from needle.train.distributed import ProcessGroup, free_port, initialize, is_primary
from needle.train.run import run_training
from needle.train.sharding import DATA_AXIS, FSDP_AXIS, make_mesh

ROOT = Path(__file__).resolve().parents[1]


def prepare(spec: dict[str, Any], directory: Path) -> None:
    """The prepared rows and tokenizer every process reads (needle.data.prepare.save_cached)."""
    cfg = model_preset(spec["preset"])
    lines = (ROOT / "data/sample/base.jsonl").read_text().splitlines()[: spec["rows"]]
    source = directory.parent / "rows.jsonl"
    source.write_text("\n".join(lines) + "\n")
    prepared = pipeline.prepare_data(DataConfig(source=str(source), max_len=cfg.max_len), vocab_size=cfg.vocab_size)
    save_cached(prepared.data, prepared.tokenizer, directory)


def _allreduce_s(n_floats: int, repeats: int = 10) -> float:
    """Median seconds of one all-reduce of ``n_floats`` float32 across every process."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = make_mesh()
    rows = NamedSharding(mesh, PartitionSpec((DATA_AXIS, FSDP_AXIS)))
    local = np.ones((len(jax.local_devices()), n_floats), np.float32)
    x = jax.make_array_from_process_local_data(rows, local, (mesh.size, n_floats))
    total = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))
    total(x).block_until_ready()  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def worker(coordinator: str, n: int, rank: int, spec: dict[str, Any], out: Path) -> None:
    """One process: train, then time the all-reduce; process 0 writes ``out``."""
    import numpy as np

    initialize(ProcessGroup(coordinator, n, rank))
    loaded = load_cached(spec["prepared"])
    assert loaded is not None, spec["prepared"]
    prepared, tok = loaded
    train = TrainConfig(mode="scratch", steps=spec["steps"], batch_size=spec["batch_size"], log_every=5,
                        checkpoint_every=10_000, eval_every=0, seed=0)  # fmt: skip
    result = run_training(prepared, tok, model_preset(spec["preset"]), train, OptimConfig(lr=1e-3, warmup_steps=0),
                          out_dir=Path(spec["out_dir"]) / f"n{n}")  # fmt: skip
    step_s = float(np.median([r["step_time_s"] for r in result.history[1:]]))  # the first window compiles
    n_params = int(result.params["params.trainable"])
    record = {"processes": n, "tokens_per_s": result.tokens_per_s, "step_s": step_s, "loss": result.train_loss,
              "params": n_params}  # fmt: skip
    if n > 1:
        record["allreduce_s"] = _allreduce_s(n_params)
        record["communication_share"] = record["allreduce_s"] / step_s
    if is_primary():
        out.write_text(json.dumps(record))


def _run(n: int, spec_path: Path, work: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    coordinator, out = f"127.0.0.1:{free_port()}", work / f"result-{n}.json"
    procs = [subprocess.Popen([sys.executable, "-m", "bench.processes", "worker", coordinator, str(n), str(rank),
                               str(spec_path), str(out)], cwd=ROOT, env=env) for rank in range(n)]  # fmt: skip
    for proc in procs:
        if proc.wait(timeout=1800):
            raise SystemExit(f"bench.processes: a {n}-process worker exited {proc.returncode}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        coordinator, n, rank, spec_path, out = argv[1:6]
        worker(coordinator, int(n), int(rank), json.loads(Path(spec_path).read_text()), Path(out))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the figures as JSON here too")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1600)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="needle-bench-proc-") as tmp:
        work = Path(tmp)
        spec = {"preset": "small", "steps": args.steps, "batch_size": args.batch_size, "rows": args.rows,
                "prepared": str(work / "prepared"), "out_dir": str(work / "runs")}  # fmt: skip
        prepare(spec, work / "prepared")
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        one, two = _run(1, spec_path, work), _run(2, spec_path, work)
    figures = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} CPUs", "spec": {
            k: spec[k] for k in ("preset", "steps", "batch_size", "rows")}, "one": one, "two": two,
        "throughput_ratio": two["tokens_per_s"] / one["tokens_per_s"],
    }  # fmt: skip
    print(f"1 process : {one['tokens_per_s']:.0f} tokens/s, {one['step_s']:.3f} s/step, loss {one['loss']:.4f}")
    print(f"2 processes: {two['tokens_per_s']:.0f} tokens/s, {two['step_s']:.3f} s/step, loss {two['loss']:.4f}")
    print(f"throughput 2/1: {figures['throughput_ratio']:.2f}x; all-reduce of {two['params']:,} floats "
          f"{two['allreduce_s'] * 1000:.1f} ms = {two['communication_share']:.1%} of a step")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
