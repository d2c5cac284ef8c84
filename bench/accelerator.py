"""Training and decoding on the accelerator: compile time, step time, share of the bf16 peak, HBM.

For each case (a real model shape with random weights, LoRA or full fine-tuning, a batch of
``rows x seq`` tokens packed two rows a sequence, the backend's own settings from
needle/hardware.py) one process, in order:

* ``compile_s``: lowering and compiling the jitted ``needle.train.step.train_step`` (the first
  step's cost); ``step_s``: the median of ``--steps`` timed steps after one warm step;
* ``tokens_per_s`` and ``mfu``: model FLOPs (bench/flops.py's formulas) per second over the bf16
  matmul peak measured at the start of the same run (bench/peak.py, 8192^3);
* ``hbm_gb``: the compiled program's own need (``memory_analysis``: arguments + temporaries +
  outputs not aliased) and ``peak_gb``: the device's ``peak_bytes_in_use`` so far in the process
  (cases run smallest first, so it is each case's peak up to the largest one before it).

``--decode`` adds bench/memory.py's decoding of the 135M shape (8 rows of ~500 prompt tokens, 96
new tokens; free, and the constrained path's device work with an all-allowed mask);
``--decode-layers 1,15`` decodes the shape cut to those depths as well, so a step's time splits
into a per-layer and a fixed part without a profiler.

    python -m bench.accelerator [--cases 135m-lora-16x1024,...] [--steps 5] [--decode [--decode-layers N,...]] [--out FILE]
                                [--set FIELD=VALUE] [--profile DIR]

A case may carry its own settings after a bar, ``135m-lora-16x1024|attention=blocked,remat=none``
(over ``--set``), ``layers=N`` cuts the shape to N blocks (a step's per-layer and fixed cost) and
``grad_accum=N`` runs the step's batch as N micro-batches (TrainConfig.grad_accum; the backend's
``micro_batch_tokens`` may split further, ``micro_batch_tokens=0`` turns that off):
one process then compares variants against the same measured peak.

A case that runs out of memory is recorded with its error and the run goes on. Prints a table and
writes JSON (default bench/results/accelerator-<backend>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from needle.config import LoraConfig, OptimConfig
from needle.hardware import prepare_platform_env, settings_for_model
from needle.model.hf.config import hf_config_to_model_config

REPO = Path(__file__).resolve().parents[1]
SHAPE_OF = {"135m": "smollm2-135m", "270m": "gemma3-270m", "0.6b": "qwen3-0.6b", "1.7b": "qwen3-1.7b"}
DEFAULT_CASES = (
    "135m-lora-16x1024", "135m-full-16x1024", "270m-lora-16x1024", "0.6b-lora-16x1024", "0.6b-full-16x1024",
    "0.6b-full-16x2048", "1.7b-lora-8x2048",
)  # fmt: skip


def parse_value(value: str) -> Any:
    """A ``--set`` value: true/false, an integer, else the string."""
    return {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``135m-lora-16x1024|attention=blocked,layers=2`` -> (the case, its settings)."""
    case, _, rest = text.partition("|")
    settings: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"case {text!r}: settings after '|' are FIELD=VALUE, got {item!r}")
        settings[key] = parse_value(value)
    return case, settings


def parse_case(text: str) -> tuple[str, str, int, int]:
    """``135m-lora-16x1024`` -> (shape, mode, rows, seq)."""
    size, mode, dims = text.split("-")
    rows, seq = (int(x) for x in dims.split("x"))
    if size not in SHAPE_OF or mode not in ("lora", "full"):
        raise ValueError(f"case {text!r}: SIZE-MODE-ROWSxSEQ with SIZE in {sorted(SHAPE_OF)}, MODE lora or full")
    return SHAPE_OF[size], mode, rows, seq


def packed_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> dict[str, Any]:
    """Random tokens, two packed rows per sequence (segment ids 1 and 2, positions restarting)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    cut = seq // 2 + 17
    positions = np.concatenate([np.arange(cut), np.arange(seq - cut)])
    segments = np.concatenate([np.ones(cut), np.full(seq - cut, 2)])
    return {
        "inputs": jnp.asarray(rng.integers(0, vocab, (rows, seq)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, vocab, (rows, seq)), jnp.int32),
        "mask": jnp.ones((rows, seq), jnp.float32),
        "positions": jnp.asarray(np.broadcast_to(positions, (rows, seq)), jnp.int32),
        "segment_ids": jnp.asarray(np.broadcast_to(segments, (rows, seq)), jnp.int32),
    }


def model_flops(cfg: Any, counts: dict[str, int], mode: str, seq: int) -> float:
    """Model FLOPs per token of a training step (bench/flops.py's formulas)."""
    attn = 6.0 * cfg.n_layers * seq * cfg.n_heads * cfg.head_dim
    head = cfg.d_model * cfg.vocab_size
    if mode == "lora":
        return 4.0 * counts["n_mat"] + 6.0 * counts["n_lora"] + attn + 4.0 * head
    return 6.0 * counts["n_mat"] + attn + 6.0 * head


def random_params(cfg: Any, lora_cfg: LoraConfig | None, settings: Any, seed: int = 0) -> Any:
    """Random weights at the model's shapes: N(0, 0.02) matrices, vectors (norm scales, biases) of
    ones, zero LoRA ``B``.

    Not the model's own init: as one jitted program (a generator per leaf) it compiled for over
    100 s on a TPU v5e for the 135M shape (2026-12-06) and 73 s on the 2-core CPU. The library now
    runs a deep model's init op by op (``lora.EAGER_INIT_MIN_LAYERS``), which would serve as well,
    but only this sampler has been measured on the TPU. One small sampler per distinct shape."""
    import jax
    import jax.numpy as jnp

    # lazy: jax loads only after main() has run prepare_platform_env
    from needle.model import lora as lora_lib

    shapes = jax.eval_shape(lambda: lora_lib.init_params(cfg, lora_cfg, seed, settings))
    normal = jax.jit(lambda k, s: 0.02 * jax.random.normal(k, s.shape, s.dtype), static_argnums=1)
    key = jax.random.key(seed)

    def sample(i: int, path: tuple[Any, ...], s: Any) -> Any:
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "lora_b":
            return jnp.zeros(s.shape, s.dtype)
        if len(s.shape) < 2:
            return jnp.ones(s.shape, s.dtype)
        return normal(jax.random.fold_in(key, i), jax.ShapeDtypeStruct(s.shape, s.dtype))

    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    return jax.tree_util.tree_unflatten(treedef, [sample(i, path, s) for i, (path, s) in enumerate(flat)])


def cut_layers(cfg: Any, layers: int, case: str) -> Any:
    """``cfg`` with ``layers`` blocks, for a shape of one layer kind (cut, a Gemma 3 pattern of
    sliding and global layers would scan a different body), as bench/memory.py's decode cut."""
    if layers < 1 or len(set(cfg.resolved_layer_types())) > 1:
        raise ValueError(f"case {case!r}: layers={layers} needs layers >= 1 and a shape of one layer kind")
    return type(cfg).model_validate({**cfg.model_dump(), "n_layers": layers, "layer_types": None})


def check_variant(variant: str) -> None:
    """Refuse a malformed ``--cases`` entry before anything is measured (a sweep stops at none)."""
    # lazy: random_model imports jax, which loads only after main() has run prepare_platform_env
    from needle.model.hf.random_model import shape_config

    case, own = parse_variant(variant)
    shape, _, rows, _ = parse_case(case)
    if rows % int(own.get("grad_accum", 1)):
        raise ValueError(f"case {variant!r}: grad_accum must divide the {rows} rows")
    if "layers" in own:
        cut_layers(hf_config_to_model_config(shape_config(shape)), own["layers"], case)


def split_cases(text: str) -> list[str]:
    """``--cases``: comma-separated cases, a case's own settings (after ``|``) kept with it."""
    out: list[str] = []
    for part in filter(None, text.split(",")):
        if out and "|" in out[-1] and "=" in part and "-" not in part.split("=")[0]:
            out[-1] += "," + part  # a further FIELD=VALUE of the case before
        else:
            out.append(part)
    return out


def _gb(x: float | None) -> float | None:
    return None if x is None else round(x / 2**30, 3)


def run_case(
    case: str, steps: int, peak_flops: float, overrides: dict[str, Any] | None = None, trace_dir: str | None = None
) -> dict[str, Any]:  # fmt: skip
    """Compile and time one case; an out-of-memory error is the record's ``error``.

    ``overrides``: BackendSettings fields over the backend's defaults (``--set remat=...``), and
    ``layers``: the shape cut to that many blocks;
    ``trace_dir``: two more steps under ``jax.profiler.trace`` (a Perfetto trace, bench/trace.py reads it)."""
    import jax

    # lazy: jax and the model code load only after main() has run prepare_platform_env
    from bench.flops import count_matmul_params
    from bench.memory import _peak_device_bytes, timed_steps
    from needle.model import lora as lora_lib
    from needle.model.decoder.scan import resolve_remat
    from needle.model.decoder.transformer import Transformer
    from needle.model.hf.random_model import shape_config
    from needle.train.run import build_state_from_params
    from needle.train.step import count_micro_batches, train_step

    shape, mode, rows, seq = parse_case(case)
    overrides = dict(overrides or {})
    layers = overrides.pop("layers", None)
    grad_accum = int(overrides.pop("grad_accum", 1))  # the batch in that many micro-batches (one step)
    cfg = hf_config_to_model_config(shape_config(shape), max_len=seq)
    settings = dataclasses.replace(settings_for_model(jax.default_backend(), cfg), **overrides)
    if layers is not None:  # after settings_for_model: the whole shape's settings, fewer blocks
        cfg = cut_layers(cfg, layers, case)
    lora_cfg = LoraConfig(rank=16) if mode == "lora" else None
    model = Transformer(cfg, lora_cfg, settings)
    micro = count_micro_batches(rows, seq, grad_accum, settings.micro_batch_tokens, jax.device_count())  # as train_step
    rec: dict[str, Any] = {"case": case, "shape": shape, "mode": mode, "rows": rows, "seq": seq, "n_layers": cfg.n_layers,
                           "settings": dataclasses.asdict(settings),
                           "grad_accum": grad_accum,
                           "micro_batches": micro,
                           # the model resolves "auto" per micro-batch (its input's shape)
                           "remat_resolved": resolve_remat(settings.remat, cfg, rows * seq // micro, trains_all=mode == "full")}  # fmt: skip
    try:
        counts = count_matmul_params(jax.eval_shape(lambda: lora_lib.init_params(cfg, lora_cfg, 0, settings)))
        # As needle.train.run.run_training: a LoRA run's frozen base in the compute dtype, blocks
        # stacked, without the host master copy it keeps for the export. The float32 params go in
        # inline, no reference left here, so they are freed once cast.
        state, _ = build_state_from_params(
            random_params(cfg, lora_cfg, settings), model, mode, OptimConfig(), 100, grad_accum=grad_accum
        )
        batch = packed_batch(cfg.vocab_size, rows, seq)
        t0 = time.perf_counter()
        compiled = jax.jit(train_step, donate_argnums=0).lower(state, batch).compile()
        rec["compile_s"] = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        if mem is not None:
            need = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            rec["hbm_gb"], rec["temp_gb"] = _gb(need), _gb(mem.temp_size_in_bytes)
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        rec["loss_first"] = float(metrics["loss"])
        rec["first_run_s"] = time.perf_counter() - t0
        state, metrics, times = timed_steps(compiled, state, batch, steps)
        step_s = sorted(times)[len(times) // 2]
        tokens = rows * seq
        flops = model_flops(cfg, counts, mode, seq) * tokens / step_s
        rec.update(step_s=step_s, tokens_per_s=tokens / step_s, tflops=flops / 1e12, mfu=flops / peak_flops,
                   loss_last=float(metrics["loss"]), params_m=(counts["n_mat"] + cfg.vocab_size * cfg.d_model) / 1e6)  # fmt: skip
        if trace_dir:
            with jax.profiler.trace(f"{trace_dir}/{case}", create_perfetto_trace=True):
                state, metrics, _ = timed_steps(compiled, state, batch, 2)
    except Exception as exc:  # noqa: BLE001 - an out-of-memory case is a result, not a crash
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    rec["peak_gb"] = _gb(_peak_device_bytes())
    return rec


def _depths(text: str) -> list[int]:
    """``--decode-layers``: comma-separated layer counts, each at least 1."""
    depths = [int(x) for x in text.split(",") if x.strip()]
    if any(n < 1 for n in depths):
        raise argparse.ArgumentTypeError(f"layer counts must be >= 1: {text!r}")
    return depths


def _step_after_prefill(dec: dict[str, Any]) -> float:
    """A free decoding step without the prefill: the warm pass less a one-token pass, per later token."""
    return (dec["free"]["warm_s"] - dec["free"]["prefill_only_s"]) / (dec["max_new_tokens"] - 1)


def format_table(result: dict[str, Any]) -> str:
    """One line per case: compile, step, tokens/s, share of the peak, HBM."""
    lines = [f"{result['device_kind']} ({result['backend']}), bf16 peak {result['peak_tflops']:.1f} TFLOP/s",
             f"{'case':<28} {'micro':>5} {'compile s':>9} {'step ms':>8} {'tok/s':>9} {'MFU':>6} {'HBM GB':>7}"]  # fmt: skip
    for r in result["cases"]:
        if "error" in r:
            lines.append(f"{r.get('variant', r['case']):<28} {r['error'][:90]}")
            continue
        lines.append(f"{r.get('variant', r['case']):<28} {r.get('micro_batches', 1):>5} {r['compile_s']:>9.1f} {r['step_s'] * 1e3:>8.1f} {r['tokens_per_s']:>9.0f} "
                     f"{r['mfu']:>6.1%} {r.get('hbm_gb') or 0:>7.2f}")  # fmt: skip
    dec = result.get("decode")
    if dec:
        for kind in ("free", "constrained"):
            d = dec[kind]
            lines.append(f"decode 135m {kind:<11}: first pass {d['first_pass_s']:.1f} s, "
                         f"{d['warm_s'] / dec['max_new_tokens'] * 1e3:.2f} ms a step warm")  # fmt: skip
    if dec and "prefill_only_s" in dec["free"]:
        depths = {str(dec.get("n_layers")): dec, **result.get("decode_layers", {})}
        for n, d in sorted(depths.items(), key=lambda kv: int(kv[0])):
            lines.append(f"decode 135m, {n:>2} layers: {_step_after_prefill(d) * 1e3:.2f} ms a free step after the prefill")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--decode-layers", type=_depths, default=[], metavar="N,...",
                    help="with --decode, also decode the 135M shape cut to N layers (per-layer vs fixed cost a step)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a BackendSettings field over the backend default, e.g. remat=nothing_saveable")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also trace two steps of each case (and a decoding pass) into DIR; summarise with bench.trace")
    args = ap.parse_args(argv)
    if args.decode_layers and not args.decode:
        ap.error("--decode-layers needs --decode")

    prepare_platform_env()
    import jax

    from bench.peak import measure_matmul_peak

    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = parse_value(value)
    backend = jax.default_backend().lower()
    peak = measure_matmul_peak(8192 if backend != "cpu" else 2048, "bfloat16", repeats=5)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "backend": backend,
                              "device_kind": jax.devices()[0].device_kind, "peak_tflops": peak["gflops"] / 1e3,
                              "cases": []}  # fmt: skip
    out = Path(args.out or REPO / "bench" / "results" / f"accelerator-{backend}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.decode:  # first: the training cases grow, and the last may run out of memory or time
        from bench.memory import child_decode

        result["decode"] = child_decode("smollm2-135m", "new", 8, args.profile)
        print(json.dumps(result["decode"]), flush=True)
        out.write_text(json.dumps(result, indent=2))
        for n in args.decode_layers:
            result.setdefault("decode_layers", {})[str(n)] = child_decode("smollm2-135m", "new", 8, None, n)
            out.write_text(json.dumps(result, indent=2))
    variants = split_cases(args.cases)
    for variant in variants:
        check_variant(variant)
    for variant in variants:
        case, own = parse_variant(variant)
        rec = run_case(case, args.steps, peak["gflops"] * 1e9, {**overrides, **own}, args.profile)
        rec["variant"] = variant
        result["cases"].append(rec)
        print(json.dumps(rec), flush=True)
        out.write_text(json.dumps(result, indent=2))
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
