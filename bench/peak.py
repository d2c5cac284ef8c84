"""The machine's limit: dense matmul throughput measured with JAX in this process.

Utilisation figures elsewhere in the benchmark divide achieved FLOP/s by this number, so it is
measured in the same run (same load, same thread count) rather than taken from a datasheet.

    python -m bench.peak            # prints f32 (and bf16 on an accelerator) GFLOP/s
"""

from __future__ import annotations

import json
import time
from typing import Any


def measure_matmul_peak(n: int = 2048, dtype: str = "float32", repeats: int = 7, inner: int = 4) -> dict[str, Any]:
    """Best-of-``repeats`` GFLOP/s of an ``n x n`` by ``n x n`` matmul in ``dtype``.

    Each repeat runs ``inner`` dependent-free matmuls and blocks once, so dispatch overhead is
    amortised; the best repeat is reported because load from other processes only ever slows
    a run down (the minimum time is the closest estimate of what the hardware can do).
    """
    import jax
    import jax.numpy as jnp

    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (n, n), dtype=jnp.float32).astype(dtype)
    b = jax.random.normal(key_b, (n, n), dtype=jnp.float32).astype(dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=x.dtype))
    matmul(a, b).block_until_ready()  # compile and warm caches outside the timing
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [matmul(a, b) for _ in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / inner)
    flops = 2.0 * n**3
    best = min(times)
    return {
        "n": n,
        "dtype": dtype,
        "repeats": repeats,
        "best_s": best,
        "median_s": sorted(times)[len(times) // 2],
        "gflops": flops / best / 1e9,
        "gflops_median": flops / sorted(times)[len(times) // 2] / 1e9,
    }


def measure_peaks(quick: bool = False) -> dict[str, Any]:
    """f32 peak always; bf16 too when JAX runs on an accelerator (where bf16 is the compute dtype)."""
    import jax

    backend = jax.default_backend().lower()
    repeats = 3 if quick else 7
    out: dict[str, Any] = {"backend": backend, "device_kind": jax.devices()[0].device_kind}
    out["f32"] = measure_matmul_peak(2048, "float32", repeats=repeats)
    if backend != "cpu":
        # An accelerator needs a bigger problem to reach its peak; 2048 would under-report.
        out["bf16"] = measure_matmul_peak(8192, "bfloat16", repeats=repeats)
    return out


if __name__ == "__main__":
    print(json.dumps(measure_peaks(), indent=2))
