"""Attention paths side by side at one layer's shape: forward and forward+backward milliseconds.

Times every attention path needle has for packed rows (the tiled XLA loops, splash, needle's flash
kernel, each at a few tile sizes) on random bf16 q, k, v of one micro-batch of a training step,
with two packed rows per sequence as bench/accelerator.py's batches, and checks each against the
first path's output and gradients. The default shape is the 135M Llama's micro-batch on a TPU
(8 rows x 1024, 9 query / 3 key-value heads of 64). On the CPU only the tiled path runs (the Pallas
kernels need a TPU; their interpreter is far too slow to time).

    python -m bench.attention [--rows 8 --seq 1024 --heads 9 --kv-heads 3 --head-dim 64]
                              [--paths tiled256,flash256,...] [--layers 60] [--out FILE.json]

``--layers`` multiplies forward+backward into the milliseconds a step spends on attention (30
layers x 2 micro-batches for the 135M shape at 16 x 1024).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any, Callable

DEFAULT_PATHS = "tiled256,tiled128,splash512,flash128,flash256,flash512"
PATH_RE = re.compile(r"(tiled|splash|flash)(\d+)")


def parse_path(name: str) -> tuple[str, int]:
    """``tiled256`` -> ("tiled", 256); a ValueError naming the form for anything else."""
    m = PATH_RE.fullmatch(name)
    if m is None:
        raise ValueError(f"path {name!r}: tiled|splash|flash followed by a block size, e.g. flash256")
    return m.group(1), int(m.group(2))


def attention_fn(name: str) -> Callable[..., Any]:
    """The attention of a path name (``tiled256``: the tiled path in tiles of 256) as f(q, k, v, seg)."""
    # lazy: jax and the kernels load after argument parsing
    from needle.model.decoder.flash import flash_attention
    from needle.model.decoder.splash import splash_attention
    from needle.model.decoder.tiled import tiled_attention

    kind, block = parse_path(name)
    if kind == "tiled":
        return lambda q, k, v, s: tiled_attention(q, k, v, s, block=block)
    if kind == "splash":
        return lambda q, k, v, s: splash_attention(q, k, v, segment_ids=s, block=block)
    return lambda q, k, v, s: flash_attention(q, k, v, s, block=block)


def time_call(fn: Callable[[], Any], repeats: int) -> float:
    """Milliseconds a call of ``fn`` takes, after warm-up calls, over ``repeats`` calls."""
    # lazy: jax loads after argument parsing
    import jax

    for _ in range(3):
        jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats * 1e3


def run_paths(args: argparse.Namespace) -> dict[str, Any]:
    """Each path's timings and its error against the first path that ran."""
    # lazy: jax loads after argument parsing
    import jax
    import jax.numpy as jnp
    import numpy as np

    b, t, h, kv, hd = args.rows, args.seq, args.heads, args.kv_heads, args.head_dim
    cut = t // 2 + 17  # as bench/accelerator.py packed_batch
    seg = jnp.asarray(np.broadcast_to(np.r_[np.ones(cut), np.full(t - cut, 2)].astype(np.int32), (b, t)))
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in
                   ((b, t, h, hd), (b, t, kv, hd), (b, t, kv, hd), (b, t, h, hd)))  # fmt: skip
    results: dict[str, Any] = {}
    ref = None
    for name in args.paths.split(","):
        try:
            attend = attention_fn(name)
            fwd = jax.jit(attend)
            grad = jax.jit(jax.grad(lambda q, k, v, s, f=attend: jnp.sum(f(q, k, v, s).astype(jnp.float32) * do),
                                    argnums=(0, 1, 2)))  # fmt: skip
            t0 = time.perf_counter()
            out = jax.block_until_ready(fwd(q, k, v, seg))
            grads = jax.block_until_ready(grad(q, k, v, seg))
            rec: dict[str, Any] = {"first_call_s": round(time.perf_counter() - t0, 2)}
            rec["fwd_ms"] = time_call(lambda: fwd(q, k, v, seg), args.repeats)
            rec["fwd_bwd_ms"] = time_call(lambda: grad(q, k, v, seg), args.repeats)
            rec["step_ms"] = rec["fwd_bwd_ms"] * args.layers
            if ref is None:
                ref = (name, out, grads)
            rec["against"] = ref[0]
            rec["out_max_diff"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[1].astype(jnp.float32))))
            rec["grad_max_rel_diff"] = max(
                float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))) / jnp.max(jnp.abs(r.astype(jnp.float32))))
                for g, r in zip(grads, ref[2])
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a path this backend cannot run is reported, the rest go on
            rec = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        results[name] = rec
        print(format_row(name, rec), flush=True)
    return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "shape":
            {"rows": b, "seq": t, "heads": h, "kv_heads": kv, "head_dim": hd}, "layers": args.layers,
            "date": time.strftime("%Y-%m-%d %H:%M"), "paths": results}  # fmt: skip


def format_row(name: str, rec: dict[str, Any]) -> str:
    """One printed line of a path's figures."""
    if "error" in rec:
        return f"{name:<11} {rec['error']}"
    return (f"{name:<11} fwd {rec['fwd_ms']:7.3f} ms  fwd+bwd {rec['fwd_bwd_ms']:7.3f} ms  a step {rec['step_ms']:6.1f} ms"
            f"  vs {rec['against']}: out {rec['out_max_diff']:.3g}, grads {rec['grad_max_rel_diff']:.3g}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--paths", default=DEFAULT_PATHS, help=f"comma-separated (default {DEFAULT_PATHS})")
    ap.add_argument("--layers", type=int, default=60, help="layer calls a step (30 layers x 2 micro-batches)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="write the figures as JSON")
    args = ap.parse_args(argv)
    for name in args.paths.split(","):
        try:
            parse_path(name)
        except ValueError as exc:
            ap.error(str(exc))
    result = run_paths(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
