"""Where a decoding call's time goes: ``generate_detailed`` against its parts, warm, best of 3.

The 135M Llama shape with random weights (bench/memory.py's model and prompts: 8 rows of about 500
tokens), on the device JAX finds: the whole call for 96 and for 1 new token, the weights' stacking
and cast (``decoding_params``), the cache's allocation (``init_cache``), the jitted decode program
alone for 1 and 96 tokens, the prefill alone, and the constrained path's host loop (a jitted step
per token, the token back on the host each time) free and with an all-allowed mask, against the
program's device loop; then that loop without the per-token sync (its Python dispatch time apart)
and bare host round trips, which split the host loop's extra time into dispatch and sync. A whole
call far above its program's time is host work (on the TPU machine, 2026-12-07, tracing the model
for every ``init_cache`` was 0.7 s of each call).

    python -m bench.decode_parts [N_LAYERS] [--out FILE] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

from needle.hardware import prepare_platform_env


def time_best_of(fn: Callable[[], Any], reps: int = 3) -> float:
    """Seconds of the fastest of ``reps`` calls after one warm-up, waiting for the device."""
    import jax  # lazy: jax loads only after main() has run prepare_platform_env

    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layers", nargs="?", type=int, default=None, help="cut the shape to this many blocks")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="also trace one warm call of the free host loop into DIR (summarise with bench.trace)")
    args = ap.parse_args(argv)

    prepare_platform_env()
    # lazy: jax and the model code load only after prepare_platform_env
    import jax
    import numpy as np

    # lazy, as jax: the model code imports it
    from bench.memory import NEW_TOKENS, PROMPT, _model
    from bench.memory import host_loop as host_loop_of
    from needle.eval.decode import _decode_batch, _prefill, decoding_params, generate_detailed, stop_array
    from needle.eval.decode import _prefill_free, _step_free
    from needle.model import lora as lora_lib
    from needle.model.decoder.transformer import init_cache

    cfg, _, model = _model("smollm2-135m", "new", lora=False, n_layers=args.layers)
    params = lora_lib.init_params(cfg, None, 0, model.settings)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, PROMPT - 4 * i).tolist() for i in range(8)]
    stop = cfg.vocab_size - 1  # random weights: rows mostly run their whole budget
    bucket = 512
    tokens = np.zeros((8, bucket), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    limits = np.full((8,), NEW_TOKENS, np.int32)
    dp = decoding_params(model, params)
    cache = init_cache(model, 8, bucket + NEW_TOKENS)
    prefill = jax.jit(_prefill, static_argnums=0)

    def generate(k: int) -> Callable[[], Any]:
        return lambda: generate_detailed(model, params, prompts, max_new_tokens=k, end_id=stop, pad_id=0, batch_size=8).n_tokens

    def program(k: int) -> Callable[[], Any]:
        return lambda: _decode_batch(model, dp, cache, tokens, lengths, limits, stop_array(stop), np.int32(0), None, max_new=k)[0]

    def host_loop(k: int, masked: bool) -> Callable[[], Any]:
        """The constrained path's loop (bench.memory.host_loop, as needle.eval.decode._decode_host),
        ``masked`` with an all-allowed bitmask: the mask's device work counts, no matcher's host time."""
        return lambda: host_loop_of(model, dp, init_cache(model, 8, bucket + NEW_TOKENS), tokens, lengths, k, masked)

    def host_loop_unsynced(k: int) -> Callable[[], Any]:
        """The free host loop feeding each step the device's token without bringing it to the
        host: the same programs, minus the per-token round trip (``dispatch_*`` is its Python time)."""

        def run() -> Any:
            c = init_cache(model, 8, bucket + NEW_TOKENS)
            t0 = time.perf_counter()
            nxt, c = _prefill_free(model, dp, c, tokens, lengths)
            pos = jax.numpy.asarray(lengths)
            for _ in range(k - 1):
                nxt, c = _step_free(model, dp, c, nxt, pos)
                pos = pos + 1
            dispatch.append(time.perf_counter() - t0)
            return nxt

        return run

    def round_trips(k: int) -> Callable[[], Any]:
        """``k`` tiny programs on an [8] int32, each result brought to the host: the sync's latency."""
        bump = jax.jit(lambda x: x + 1)

        def run() -> Any:
            x = np.zeros(8, np.int32)
            for _ in range(k):
                x = np.asarray(bump(x))
            return x

        return run

    dispatch: list[float] = []
    parts = {
        f"generate_{NEW_TOKENS}": generate(NEW_TOKENS), "generate_1": generate(1),
        "decoding_params": lambda: decoding_params(model, params), "init_cache": lambda: init_cache(model, 8, bucket + NEW_TOKENS),
        f"decode_program_{NEW_TOKENS}": program(NEW_TOKENS), "decode_program_1": program(1),
        "prefill": lambda: prefill(model, dp, cache, tokens, lengths)[0],
        f"host_loop_free_{NEW_TOKENS}": host_loop(NEW_TOKENS, masked=False),
        f"host_loop_masked_{NEW_TOKENS}": host_loop(NEW_TOKENS, masked=True),
        f"host_loop_unsynced_{NEW_TOKENS}": host_loop_unsynced(NEW_TOKENS),
        f"round_trips_{NEW_TOKENS}": round_trips(NEW_TOKENS),
    }  # fmt: skip
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "backend": jax.default_backend(), "n_layers": cfg.n_layers}
    for name, fn in parts.items():
        result[name + "_s"] = time_best_of(fn)
        print(f"{name:<24} {result[name + '_s'] * 1e3:9.2f} ms", flush=True)
    if dispatch:  # the unsynced loop's Python time, fastest call (its first is the warm-up)
        result[f"dispatch_{NEW_TOKENS}_s"] = min(dispatch)
        print(f"{'dispatch_' + str(NEW_TOKENS):<24} {min(dispatch) * 1e3:9.2f} ms", flush=True)
    if args.profile:
        loop = parts[f"host_loop_free_{NEW_TOKENS}"]
        with jax.profiler.trace(str(args.profile / "host_loop_free"), create_perfetto_trace=True):
            jax.block_until_ready(loop())
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
