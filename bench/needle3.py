"""Needle 3 fine-tuning, cactus-needle's loop against needle's, on the same base, rows and recipe.

One base is made by cactus-needle itself (bench/cactus_worker.py in its side virtualenv: a
random checkpoint at ``CONFIG``, a small-but-real Needle 3 shape with every switch on, and a
stand-in SentencePiece tokenizer with Needle's ids), kept in the hub repository's layout. Then:

- cactus-needle: ``finetune_local`` (quantisation-aware LoRA, rank/alpha as below, one epoch);
- needle: the library's own stages (``prepare_data``, ``obtain_base``, ``train``) on that
  directory, LoRA with the same rank, alpha, batch (rows per step, no packing), steps, peak lr,
  warmup, cosine decay, clip and AdamW settings, quantisation-aware as Needle trains.

Both report the median steady step time and the final training loss; the section prints the
step-time ratio (cactus / needle, above 1 means needle is faster).

A second part (``--published``) makes a random checkpoint at cactus-needle 3.2.8's default
``TransformerConfig`` (20 layers, d_model 768: the published model's class; its exact config is
in the hub checkpoint's metadata) with cactus-needle's own code, then loads it in needle, tunes
a few LoRA steps and exports it, in a child process: load time, step time, peak RSS.

    python -m bench.run --sections needle3            # or: python -m bench.needle3 [--published]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from needle.config import DataConfig, LoraConfig, training_configs
from needle.model.needle3.export import export_needle
from needle.pipeline import obtain_base, prepare_data, train

ROWS = 320
BATCH = 8
RANK, ALPHA, LR = 16, 32.0, 1e-3
CONFIG: dict[str, Any] = dict(
    vocab_size=2048, d_model=256, num_heads=4, num_kv_heads=2, num_layers=4, qk_head_dim=48, v_head_dim=64,
    max_seq_len=1024, engram_heads=2, engram_slots=2048, engram_layers=(1, 3), global_layers=(3,),
    sliding_window=128, mhc_lanes=4, qkv_conv_taps=3, embedding_dim=64,
)  # fmt: skip


def _cactus_losses(log: list[str]) -> list[float]:
    out = []
    for line in log:
        parts = line.split()
        if len(parts) >= 5 and parts[1] == "step" and parts[3] == "loss":
            out.append(float(parts[4]))
    return out


def run_needle(base_dir: Path, jsonl: Path, steps: int, warmup: int, work: Path) -> dict[str, Any]:
    """needle's LoRA fine-tune of the Needle 3 base through the library's stages; step times and loss."""
    base = obtain_base(str(base_dir))
    data_cfg = DataConfig(source=str(jsonl), max_len=base.loaded.model_cfg.max_len, val_fraction=0.1, test_fraction=0.0)
    prepared = prepare_data(data_cfg, tokenizer=base.loaded.tokenizer)
    train_cfg, optim_cfg = training_configs(
        "lora", steps=steps, batch_size=BATCH,
        train={"packing": False, "log_every": 1, "checkpoint_every": steps, "compilation_cache_dir": None},
        optim={"lr": LR, "warmup_steps": warmup, "min_lr_ratio": 0.0, "weight_decay": 1e-4, "b2": 0.999},
    )  # fmt: skip
    t0 = time.perf_counter()
    trained = train(prepared, base.loaded.model_cfg, train_cfg, optim_cfg, LoraConfig(rank=RANK, alpha=ALPHA),
                    base=base, out_dir=work / "needle-run")  # fmt: skip
    wall = time.perf_counter() - t0
    times = [h["step_time_s"] for h in trained.history if "step_time_s" in h][1:]  # the first holds the compile
    return {"status": "ok", "wall_s": wall, "steps": trained.final_step,
            "step_s": statistics.median(times) if times else None, "final_loss": trained.train_loss}  # fmt: skip


def bench_needle3() -> dict[str, Any]:
    from bench.cactus import run_cactus
    from bench.fixtures import ensure_jsonl

    jsonl = ensure_jsonl(ROWS)
    with tempfile.TemporaryDirectory(prefix="bench-needle3-") as tmp:
        base_dir = Path(tmp, "base")
        spec = {"jsonl": str(jsonl), "vocab_size": CONFIG["vocab_size"], "n3_config": CONFIG, "keep_dir": str(base_dir),
                "max_len": 512, "lora_rank": RANK, "lora_alpha": ALPHA, "lr": LR, "val_split": 0.1,
                "batch_size": BATCH, "epochs": 1, "seed": 0, "score": False, "n_heads": CONFIG["num_heads"]}  # fmt: skip
        cactus = run_cactus(spec)
        if not cactus.get("ok"):
            return {"status": "failed", "error": cactus.get("error"), "cactus": cactus}
        losses = _cactus_losses(cactus.get("log", []))
        steps = cactus.get("steps") or len(losses)
        warmup = min(max(1, steps // 20), steps - 1)  # cactus-needle's own warmup rule
        ours = run_needle(base_dir, jsonl, steps, warmup, Path(tmp))
    out = {
        "status": "ok", "config": CONFIG, "rows": ROWS, "batch_rows": BATCH, "steps": steps, "lora_rank": RANK,
        "n_params": cactus["base"]["n_params"],
        "cactus": {"step_s": cactus.get("step_s"), "final_loss": losses[-1] if losses else None,
                   "wall_s": cactus.get("wall_s"), "seq_len": cactus.get("seq_len"),
                   "version": cactus.get("package_version")},
        "needle": ours,
    }  # fmt: skip
    if out["cactus"]["step_s"] and ours.get("step_s"):
        out["step_time_ratio"] = out["cactus"]["step_s"] / ours["step_s"]
    return out


def measure_published(base_dir: Path, jsonl: Path, work: Path, steps: int = 4, batch: int = 2) -> dict[str, Any]:
    """Load, LoRA-tune ``steps`` steps and export a base at the published shape; times and peak RSS.

    Runs in its own process (``--published-child``) so the peak resident memory is this work's alone.
    """
    import resource

    t0 = time.perf_counter()
    base = obtain_base(str(base_dir), max_len=512)
    load_s = time.perf_counter() - t0
    prepared = prepare_data(DataConfig(source=str(jsonl), max_len=512, val_fraction=0.1, test_fraction=0.0),
                            tokenizer=base.loaded.tokenizer)  # fmt: skip
    train_cfg, optim_cfg = training_configs(
        "lora", steps=steps, batch_size=batch,
        train={"packing": False, "log_every": 1, "checkpoint_every": steps, "compilation_cache_dir": None},
    )  # fmt: skip
    trained = train(prepared, base.loaded.model_cfg, train_cfg, optim_cfg, LoraConfig(rank=RANK, alpha=ALPHA),
                    base=base, out_dir=work / "published-run")  # fmt: skip
    times = [h["step_time_s"] for h in trained.history if "step_time_s" in h]
    t1 = time.perf_counter()
    files = export_needle(trained.model_dir, work / "published-export")
    export_s = time.perf_counter() - t1
    return {
        "status": "ok", "n_params": base.loaded.meta["base"]["n_params"], "load_s": load_s, "steps": steps,
        "batch_rows": batch, "first_step_s": times[0] if times else None,
        "step_s": statistics.median(times[1:]) if len(times) > 1 else None, "export_s": export_s,
        "cact_bytes": files["model.cact"].stat().st_size, "checkpoint_bytes": files["checkpoint.safetensors"].stat().st_size,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }  # fmt: skip


def bench_published() -> dict[str, Any]:
    """A random checkpoint at cactus-needle 3.2.8's default (published-class) shape, made by cactus-needle."""
    import subprocess

    from bench.cactus import run_cactus
    from bench.fixtures import REPO, ensure_jsonl

    jsonl = ensure_jsonl(ROWS)
    with tempfile.TemporaryDirectory(prefix="bench-needle3-pub-") as tmp:
        base_dir = Path(tmp, "base")
        spec = {"jsonl": str(jsonl), "vocab_size": 16384, "n3_config": {}, "keep_dir": str(base_dir),
                "base_only": True, "seed": 0}  # fmt: skip
        made = run_cactus(spec, timeout_s=3600)
        if not made.get("ok"):
            return {"status": "failed", "error": made.get("error")}
        out = Path(tmp, "published.json")
        done = subprocess.run([sys.executable, "-m", "bench.needle3", "--published-child", str(base_dir), str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=3 * 3600)  # fmt: skip
        if not out.exists():
            return {"status": "failed", "error": f"exit {done.returncode}: {done.stderr[-800:]}"}
        return {**json.loads(out.read_text()), "config": made["base"]["config"], "tokenizer_vocab": made["tokenizer_vocab"]}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the JSON here too")
    parser.add_argument("--published", action="store_true", help="also the published-shape base (slow)")
    parser.add_argument("--published-child", nargs=2, metavar=("BASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.published_child:
        from bench.fixtures import ensure_jsonl

        with tempfile.TemporaryDirectory(prefix="bench-needle3-child-") as tmp:
            r = measure_published(Path(args.published_child[0]), ensure_jsonl(ROWS), Path(tmp))
        Path(args.published_child[1]).write_text(json.dumps(r, indent=2))
        return 0
    result = bench_needle3()
    if args.published:
        result["published"] = bench_published()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
