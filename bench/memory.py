"""Memory and speed of real model shapes (issue 20): LoRA training and decoding, old vs new paths.

For each shape of ``needle.model.hf.random_model.SHAPES`` (random weights: the 135M Llama shape
``smollm2-135m``, ``gemma3-270m``, ``qwen3-0.6b``) and each path, in its own process:

* ``train``: LoRA (rank 16, every projection) on a batch of ``4 x 640`` random tokens, one
  compiled step then ``--steps`` timed ones: tokens/s, model GFLOP/s (bench/flops.py's counting)
  and their share of the f32 matmul peak measured in the same run (bench/peak.py), peak memory
  (the process's peak RSS on CPU, ``memory_stats()["peak_bytes_in_use"]`` on a GPU);
* ``decode``: ``--rows`` prompts of about 500 tokens (bucket 512) and up to 96 new tokens,
  through needle/eval/decode.py: free decoding (one compiled loop) and the constrained path's
  device work (prefill + one jitted masked step per token on a host loop, with an all-allowed
  bitmask, so no grammar matcher's host time is counted): rows/s after a first compiling pass.

``recompute`` is ``new`` with ``remat="recompute"`` (needle/model/decoder/recompute.py).
``old`` is the code before issue 20, selected by config (``needle.hardware.old_paths``: remat
"none", attention "dense", loss_chunk 0, which also makes prefill form full ``[B, P, V]``
logits); ``new`` is the backend's defaults (needle/hardware.py) and, on CPU, XLA's
memory-minimising scheduler (``needle.hardware.cpu_xla_flags``, which ``prepare_platform_env``
sets). A process whose RSS passes
``--rss-limit-gb`` stops itself and is recorded as over the limit (the machine is shared).

    python -m bench.memory [--shapes smollm2-135m,gemma3-270m] [--paths old,new] [--steps 2]
                           [--out bench/results/memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.report import write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SHAPES = ("smollm2-135m", "gemma3-270m", "qwen3-0.6b")
BATCH, SEQ, LORA_RANK = 4, 640, 16
PROMPT, NEW_TOKENS = 500, 96


class RssWatch:
    """Peak RSS of this process, sampled every 20 ms; past ``limit_bytes`` it writes ``out`` and exits."""

    def __init__(self, limit_bytes: float, out: Path, record: dict[str, Any]) -> None:
        import psutil

        self.proc, self.limit, self.out, self.record = psutil.Process(), limit_bytes, out, record
        self.peak = self.proc.memory_info().rss
        self.start_rss = self.peak
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            rss = self.proc.memory_info().rss
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.record.update(status="over_limit", peak_rss_gb=rss / 2**30,
                                   error=f"RSS passed the {self.limit / 2**30:.1f} GB limit; stopped")  # fmt: skip
                self.out.write_text(json.dumps(self.record, indent=2))
                os._exit(3)
            time.sleep(0.02)


def _model(shape: str, path: str, lora: bool, n_layers: int | None = None) -> tuple[Any, Any, Any]:
    import jax

    # lazy: jax loads after main() sets JAX_PLATFORMS, the model code after RssWatch takes the start RSS
    from needle.config import LoraConfig
    from needle.hardware import old_paths, settings_for_model, with_overrides
    from needle.model.hf.config import hf_config_to_model_config
    from needle.model.hf.random_model import shape_config
    from needle.model.decoder.transformer import Transformer

    cfg = hf_config_to_model_config(shape_config(shape), max_len=1024)
    settings = settings_for_model(jax.default_backend(), cfg)  # as run_training picks them
    if n_layers is not None:  # the shape with fewer blocks, the same program: what a step costs per layer
        if len(set(cfg.resolved_layer_types())) > 1 or n_layers < 1:
            raise ValueError(f"{shape}: n_layers={n_layers} needs a shape of one layer kind and n_layers >= 1")
        cfg = type(cfg).model_validate({**cfg.model_dump(), "n_layers": n_layers, "layer_types": None})
    if path == "old":
        settings = old_paths(settings)
    elif path == "recompute":  # the new path with each block recomputed in a custom VJP
        settings = with_overrides(settings, remat="recompute")
    lora_cfg = LoraConfig(rank=LORA_RANK) if lora else None
    return cfg, lora_cfg, Transformer(cfg, lora_cfg, settings)


def _peak_device_bytes() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return float(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def child_train(shape: str, path: str, steps: int, watch: RssWatch) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    # lazy, as in _model
    from bench.flops import count_matmul_params
    from needle.config import OptimConfig
    from needle.model import lora as lora_lib
    from needle.train.run import build_state_from_params
    from needle.train.step import train_step

    cfg, lora_cfg, model = _model(shape, path, lora=True)
    counts = count_matmul_params(jax.eval_shape(lambda: lora_lib.init_params(cfg, lora_cfg, 0, model.settings)))
    # The state as needle.train.run.run_training builds it (the frozen base in the compute dtype, a
    # scanned model's blocks stacked; no host master copy), so the peak is the library's.
    state, _ = build_state_from_params(lora_lib.init_params(cfg, lora_cfg, 0, model.settings), model, "lora",
                                       OptimConfig(), 100)  # fmt: skip
    rng = np.random.default_rng(0)
    batch = {"inputs": jnp.asarray(rng.integers(0, cfg.vocab_size, (BATCH, SEQ)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, cfg.vocab_size, (BATCH, SEQ)), jnp.int32),
             "mask": jnp.ones((BATCH, SEQ), jnp.float32)}  # fmt: skip
    step = jax.jit(train_step, donate_argnums=0)
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    loss0 = float(metrics["loss"])
    first_s = time.perf_counter() - t0
    state, metrics, times = timed_steps(step, state, batch, steps)
    step_s = sorted(times)[len(times) // 2] if times else first_s
    # Model FLOPs per token (bench/flops.py's LoRA formula; attention at n_heads * head_dim wide).
    attn_width = cfg.n_heads * cfg.head_dim
    per_token = (4.0 * counts["n_mat"] + 6.0 * counts["n_lora"] + 6.0 * cfg.n_layers * SEQ * attn_width
                 + 4.0 * cfg.d_model * cfg.vocab_size)  # fmt: skip
    tokens = BATCH * SEQ
    return {
        "settings": {k: getattr(model.settings, k) for k in ("remat", "attention", "loss_chunk", "compute_dtype")},
        "params_m": (counts["n_mat"] + cfg.vocab_size * cfg.d_model) / 1e6, "first_step_s": first_s,
        "step_s": step_s, "step_times_s": times, "tokens_per_s": tokens / step_s, "gflops": per_token * tokens / step_s / 1e9,
        "loss_first": loss0, "loss_last": float(metrics["loss"]), "peak_device_gb": _gb(_peak_device_bytes()),
    }  # fmt: skip


def timed_steps(step: Any, state: Any, batch: Any, n: int) -> tuple[Any, Any, list[float]]:
    """``n`` calls of ``step(state, batch)``, each timed to its loss being ready: (state, metrics, seconds)."""
    import jax

    times, metrics = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return state, metrics, times


def _gb(x: float | None) -> float | None:
    return None if x is None else x / 2**30


def host_loop(model: Any, weights: Any, cache: Any, tokens: Any, lengths: Any, new_tokens: int, masked: bool) -> Any:
    """``needle.eval.decode._decode_host``'s device work for ``new_tokens`` tokens a row, without a
    grammar: each step's forward pass queued before the last token is read on the host; ``masked``
    picks through an all-allowed bitmask sent from the host every step, as the library sends its
    matchers' masks. ``weights`` as ``decoding_params`` gives them. Returns the last tokens."""
    import jax.numpy as jnp  # lazy, as in _model
    import numpy as np

    # lazy, as in _model
    from needle.eval.decode import _pick_masked, _prefill_free, _prefill_masked, _step_free, _step_logits

    rows, vocab = tokens.shape[0], model.cfg.vocab_size
    bits = np.full((rows, -(-vocab // 32)), -1, np.int32)
    closing, scores = np.zeros(rows, np.int32), jnp.zeros((2, vocab), jnp.float32)
    if masked:
        tok, cache = _prefill_masked(model, weights, cache, tokens, lengths, bits, closing, scores)
    else:
        tok, cache = _prefill_free(model, weights, cache, tokens, lengths)
    pos = lengths.copy()
    for _ in range(new_tokens - 1):
        if masked:
            logits, cache = _step_logits(model, weights, cache, tok, pos)
            np.asarray(tok)
            tok = _pick_masked(logits, bits, closing, scores)
        else:
            ahead, cache = _step_free(model, weights, cache, tok, pos)
            np.asarray(tok)
            tok = ahead
        pos = pos + 1
    return np.asarray(tok)


def child_decode(
    shape: str, path: str, rows: int, trace_dir: str | None = None, n_layers: int | None = None
) -> dict[str, Any]:  # fmt: skip
    """Free and constrained decoding of ``rows`` prompts: first pass and warm pass; with
    ``trace_dir`` a third pass of each runs under ``jax.profiler.trace`` (a Perfetto trace per kind).
    ``free.prefill_only_s`` is a warm pass of one new token, so ``(warm_s - prefill_only_s) /
    (max_new_tokens - 1)`` is a decoding step without the prefill; ``n_layers`` replaces the shape's
    depth (a Llama-like shape: every layer the same kind), which splits a step into per-layer and fixed cost."""
    import jax
    import numpy as np

    # lazy, as in _model
    from needle.eval.decode import decoding_params, generate_detailed
    from needle.model import lora as lora_lib
    from needle.model.decoder.transformer import init_cache

    cfg, _, model = _model(shape, path, lora=False, n_layers=n_layers)
    params = lora_lib.init_params(cfg, None, 0, model.settings)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, PROMPT - 4 * i).tolist() for i in range(rows)]
    stop = cfg.vocab_size - 1  # random weights: rows mostly run their whole budget
    out: dict[str, Any] = {"rows": rows, "prompt_tokens": PROMPT, "max_new_tokens": NEW_TOKENS}

    def free(new_tokens: int = NEW_TOKENS) -> Any:
        return generate_detailed(model, params, prompts, max_new_tokens=new_tokens, end_id=stop, pad_id=0, batch_size=rows)

    def constrained() -> int:
        # The constrained path's device work (decode.py's host loop) with an all-allowed mask, on
        # the weights as generate_detailed hands them to that loop (stacked, in the compute dtype):
        # the raw tree would re-stack and re-cast every block inside every step.
        weights = decoding_params(model, params)
        bucket = 512
        tokens = np.zeros((rows, bucket), np.int32)
        lengths = np.array([len(p) for p in prompts], np.int32)
        for r, p in enumerate(prompts):
            tokens[r, : len(p)] = p
        host_loop(model, weights, init_cache(model, rows, bucket + NEW_TOKENS), tokens, lengths, NEW_TOKENS, masked=True)
        return NEW_TOKENS

    for name, fn in (("free", free), ("constrained", constrained)):
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = fn()
        warm = time.perf_counter() - t0
        made = res.n_tokens if name == "free" else res * rows
        out[name] = {"first_pass_s": first, "warm_s": warm, "rows_per_s": rows / warm, "tokens": made,
                     "tokens_per_s": made / warm}  # fmt: skip
        if trace_dir:
            with jax.profiler.trace(f"{trace_dir}/decode-{name}", create_perfetto_trace=True):
                fn()
    free(1)  # compiles the one-token program
    t0 = time.perf_counter()
    free(1)
    out["free"]["prefill_only_s"] = time.perf_counter() - t0
    out["n_layers"] = cfg.n_layers
    out["peak_device_gb"] = _gb(_peak_device_bytes())
    return out


def run_child(kind: str, shape: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One (kind, shape, path) in a fresh process; its JSON record."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "bench.memory", "--child", kind, shape, path, str(out),
               "--steps", str(args.steps), "--rows", str(args.rows), "--rss-limit-gb", str(args.rss_limit_gb)]  # fmt: skip
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        if path in ("new", "recompute"):  # the new path's environment: XLA's memory-aware CPU scheduler
            # lazy, as in _model: each child imports this module before its RssWatch starts
            from needle.hardware import cpu_xla_flags

            env["XLA_FLAGS"] = cpu_xla_flags(env.get("XLA_FLAGS", ""))
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"timed out after {args.timeout_s} s"}
        if not out.exists():
            return {"status": "failed", "error": f"exited {done.returncode}: {done.stderr[-800:]}"}
        rec = json.loads(out.read_text())
        rec["wall_s"] = time.perf_counter() - t0
        return rec


def child_main(kind: str, shape: str, path: str, out: Path, args: argparse.Namespace) -> int:
    record: dict[str, Any] = {"kind": kind, "shape": shape, "path": path}
    watch = RssWatch(args.rss_limit_gb * 2**30, out, record)
    try:
        import jax

        record["backend"] = jax.default_backend()
        res = child_train(shape, path, args.steps, watch) if kind == "train" else child_decode(shape, path, args.rows)
        record.update(status="ok", **res)
    except Exception as exc:  # a failed measurement is data
        import traceback

        record.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
    record["peak_rss_gb"] = watch.peak / 2**30
    record["start_rss_gb"] = watch.start_rss / 2**30
    out.write_text(json.dumps(record, indent=2, default=str))
    return 0


def _ratio(new: dict[str, Any], old: dict[str, Any], *keys: str) -> float | None:
    a, b = new, old
    for k in keys:
        a, b = (a or {}).get(k), (b or {}).get(k)
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from bench.peak import measure_matmul_peak

    peak = measure_matmul_peak(2048, "float32", repeats=3)
    result: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "batch": BATCH, "seq_len": SEQ,
                              "lora_rank": LORA_RANK, "peak_f32_gflops": peak["gflops"],
                              "loadavg_start": os.getloadavg()[0], "shapes": {}}  # fmt: skip
    for shape in args.shapes.split(","):
        per: dict[str, Any] = {}
        for path in args.paths.split(","):
            per[path] = {kind: run_child(kind, shape, path, args) for kind in args.kinds.split(",")}
            tr = per[path].get("train", {})
            if tr.get("gflops"):
                tr["share_of_peak"] = tr["gflops"] / peak["gflops"]
            print(json.dumps({shape: {path: _summary(per[path])}}), flush=True)
        old, new = per.get("old", {}), per.get("new", {})
        per["new_over_old"] = {
            "train_tokens_per_s": _ratio(new.get("train"), old.get("train"), "tokens_per_s"),
            "train_peak_rss": _ratio(new.get("train"), old.get("train"), "peak_rss_gb"),
            "decode_free_rows_per_s": _ratio(new.get("decode"), old.get("decode"), "free", "rows_per_s"),
            "decode_constrained_rows_per_s": _ratio(new.get("decode"), old.get("decode"), "constrained", "rows_per_s"),
        }
        result["shapes"][shape] = per
    result["loadavg_end"] = os.getloadavg()[0]
    return result


def _summary(rec: dict[str, Any]) -> dict[str, Any]:
    tr, de = rec.get("train", {}), rec.get("decode", {})
    return {"train": {k: tr.get(k) for k in ("status", "tokens_per_s", "share_of_peak", "peak_rss_gb", "error")},
            "decode": {"status": de.get("status"), "peak_rss_gb": de.get("peak_rss_gb"),
                       "free_rows_per_s": (de.get("free") or {}).get("rows_per_s"),
                       "constrained_rows_per_s": (de.get("constrained") or {}).get("rows_per_s")}}  # fmt: skip


def format_table(result: dict[str, Any]) -> str:
    lines = ["| shape | path | train tok/s | share of peak | train peak RSS GB | free rows/s | constrained rows/s | decode RSS GB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    f = lambda x, p=2: "-" if not isinstance(x, (int, float)) else f"{x:.{p}f}"  # noqa: E731
    for shape, per in result["shapes"].items():
        for path in ("old", "new", "recompute"):
            if path not in per:
                continue
            s = _summary(per[path])
            tr, de = s["train"], s["decode"]
            tok = f(tr["tokens_per_s"], 1) if tr["status"] == "ok" else f"{tr['status']}"
            lines.append(f"| {shape} | {path} | {tok} | {f(tr['share_of_peak'])} | {f(tr['peak_rss_gb'])} | "
                         f"{f(de['free_rows_per_s'], 3)} | {f(de['constrained_rows_per_s'], 3)} | {f(de['peak_rss_gb'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=4, metavar=("KIND", "SHAPE", "PATH", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    p.add_argument("--paths", default="old,new")
    p.add_argument("--kinds", default="train,decode")
    p.add_argument("--steps", type=int, default=2, help="timed train steps after the compiled one")
    p.add_argument("--rows", type=int, default=4, help="prompts decoded together")
    p.add_argument("--rss-limit-gb", type=float, default=16.0)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--out", default="bench/results/memory.json")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.child:
        kind, shape, path, out = args.child
        return child_main(kind, shape, path, Path(out), args)
    result = measure(args)
    write_result(result, args.out, format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
