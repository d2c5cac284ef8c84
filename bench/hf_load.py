"""Benchmark: importing a ~500M-parameter Hugging Face checkpoint (load seconds, peak RSS).

Generates a random Qwen3-shaped checkpoint in bf16 (``model.safetensors`` written directly in
the safetensors format, no torch; a small tokenizer so ``load_model`` works), then measures, each
in a fresh child process so ``ru_maxrss`` belongs to that load alone:

- ``load_hf_params(dir, cfg)``: the tensor-by-tensor safetensors reader;
- ``needle.model.io.load_model(dir)``: the whole import (config, tokenizer, params, meta).

Peak RSS is the child's VmHWM; the baseline is its RSS with jax and the CPU backend up.

It prints the figures and writes them to bench/results/hf_load.json. Run from the repository
root (needs ~1.1 GB of disk under --dir and ~3 GB of memory):

    python -m bench.hf_load [--layers 24] [--dir /tmp/needle-hf-bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from needle.model.hf.config import hf_config_to_model_config
from needle.model.hf.weights import expected_shapes, load_hf_params
from needle.model.io import load_model

RESULTS = Path(__file__).parent / "results" / "hf_load.json"


def qwen3_config(n_layers: int) -> dict:
    """Qwen3-0.6B's shape (tied, head_dim 128) with ``n_layers`` layers: 24 layers ~ 533M params."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": n_layers, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu", "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }  # fmt: skip


def _random_bf16(n: int, rng: np.random.Generator) -> bytes:
    # bf16 is the top half of a float32: generate float32 and keep the high 16 bits.
    x = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
    return (x >> 16).astype("<u2").tobytes()


def write_checkpoint(out: Path, n_layers: int, seed: int = 0) -> tuple[int, int]:
    """Write config.json, model.safetensors (bf16, streamed tensor by tensor), tokenizer; return
    (n_params, file bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    config = qwen3_config(n_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shapes = expected_shapes(hf_config_to_model_config(config))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data section starts 8-byte aligned
    rng = np.random.default_rng(seed)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for shape in shapes.values():
            f.write(_random_bf16(int(np.prod(shape)), rng))
    _write_tokenizer(out)
    return sum(int(np.prod(s)) for s in shapes.values()), (out / "model.safetensors").stat().st_size


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"])
    tok.train_from_iterator(["a tiny tokenizer for the load benchmark"] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))


def _rss_mb(field: str = "VmRSS") -> float:
    """Current RSS (VmRSS) or this process image's peak (VmHWM), in MB.

    Not getrusage's ru_maxrss: Linux carries it across fork and execve, so a child would report
    the parent's peak (here: generating the checkpoint).
    """
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def measure(model_dir: str, what: str) -> dict:
    """In this process: import jax, then time one load; peak RSS is the process's VmHWM."""
    import jax
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # backend up before the baseline

    base_mb = _rss_mb()
    t0 = time.perf_counter()
    if what == "load_hf_params":
        params = load_hf_params(model_dir, hf_config_to_model_config(model_dir))
    else:
        params = load_model(model_dir).params
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak_mb = _rss_mb("VmHWM")
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(params)})
    return {"seconds": round(seconds, 2), "baseline_rss_mb": round(base_mb), "peak_rss_mb": round(peak_mb),
            "end_rss_mb": round(_rss_mb()), "dtypes": dtypes, "backend": jax.default_backend()}  # fmt: skip


def _child(model_dir: Path, what: str) -> dict:
    cmd = [sys.executable, "-m", "bench.hf_load", "--measure", str(model_dir), "--what", what]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/needle-hf-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--what", default="load_hf_params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.what)))
        return
    t0 = time.perf_counter()
    n_params, size = write_checkpoint(args.dir, args.layers)
    result = {"checkpoint": {"arch": "qwen3", "layers": args.layers, "n_params": n_params, "dtype": "bfloat16",
                             "bytes": size, "write_seconds": round(time.perf_counter() - t0, 1)}}  # fmt: skip
    for what in ("load_hf_params", "load_model"):
        r = _child(args.dir, what)
        r["peak_over_checkpoint"] = round(r["peak_rss_mb"] * 2**20 / size, 2)
        r["added_over_checkpoint"] = round((r["peak_rss_mb"] - r["baseline_rss_mb"]) * 2**20 / size, 2)
        result[what] = r
        print(f"{what}: {r['seconds']} s, peak RSS {r['peak_rss_mb']} MB (baseline {r['baseline_rss_mb']} MB) "
              f"= {r['peak_over_checkpoint']}x the {size / 2**20:.0f} MB checkpoint "
              f"({r['added_over_checkpoint']}x above baseline), params {r['dtypes']}")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{n_params / 1e6:.0f}M params; wrote {RESULTS}")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
