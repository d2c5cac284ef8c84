"""A bench.accelerator case compiled for a TPU on a host without one: HBM need, optimized HLO, XLA's estimate.

libtpu describes a TPU topology (``v5e:1x1``: one v5e chip) and compiles for one of its chips on
any x86-64 Linux host; nothing runs. This builds bench/accelerator.py ``run_case``'s program (its
case syntax and settings: ``settings_for_model("tpu", cfg)``, LoRA rank 16, blocks stacked, a LoRA
run's frozen base in the compute dtype, ``jit(train_step, donate_argnums=0)``) on abstract
inputs, and writes

* ``DIR/<case>.hlo.txt``: the optimized HLO, the program the TPU would run (its instruction names
  matched a profile of the real run made with the same jax and libtpu versions);
* ``DIR/<case>.json``: ``memory_analysis`` (argument, temporary, output and aliased bytes, and the
  HBM need: arguments + temporaries + outputs not aliased, which is what ``hbm_gb`` of
  bench.accelerator reports; on a TPU v5e it equalled what the real chip reported), whether it
  fits the chip, lowering and compile seconds on this host, remat as resolved, the settings, model
  FLOPs a step, and the custom calls present (``mosaic_kernels``: the Pallas/Mosaic kernels, e.g.
  splash attention); with ``--cycles`` also bench/hlo_cycles.py's step-time proxy (XLA's cost
  model, not a measurement: see there), which it prints as well.

    python -m bench.aot CASE[|FIELD=VALUE,...] [--set FIELD=VALUE] [--topology v5e:1x1] [--hbm-gb GIB]
                        [--out DIR] [--cycles]

Needs libtpu (``pip install -e '.[tpu]'``; no TPU needed); without it, or for a topology libtpu
does not know, it exits 2 with one line. The HBM that remat "auto" plans for and the fit is
judged against: ``--hbm-gb``, by default what the chip reports (v5e: 15.75 GiB).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.accelerator import check_variant, cut_layers, model_flops, parse_case, parse_value, parse_variant
from bench.hlo_cycles import HloModule, estimate_cycles, format_report, parse_hlo

REPO = Path(__file__).resolve().parents[1]
TOPOLOGY_RE = re.compile(r"v\w+:\d+(x\d+)*")
# Device memory as the real chip reports it (jax's bytes_limit), by device kind.
HBM_GIB = {"TPU v5 lite": 15.75}
# Set before libtpu loads: a single host described here, so libtpu does not query GCE's metadata
# server (there is none off Google Cloud); the runtime backend stays the CPU, the TPU is compile-only.
# (Without them libtpu logs one harmless error line and still compiles.)
TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
# The accelerator type a one-host topology names, where it is known.
ACCELERATOR_TYPE = {"v5e:1x1": "v5litepod-1", "v5e:2x2": "v5litepod-4"}
TOP = 25


class Refused(Exception):
    """Why nothing can be compiled here (no libtpu, an unknown topology, a malformed case): one line."""


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def get_topology_devices(name: str) -> list[Any]:
    """The compile-only devices of a TPU topology (``v5e:1x1``, ``v5e:2x2``), from libtpu."""
    if not has_libtpu():
        raise Refused("libtpu is not installed: pip install -e '.[tpu]' (any x86-64 Linux host; no TPU needed)")
    for key, value in TPU_ENV.items():
        os.environ.setdefault(key, value)
    if name in ACCELERATOR_TYPE:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", ACCELERATOR_TYPE[name])
    # lazy: libtpu reads TPU_ENV when it loads
    from jax.experimental import topologies

    chips = 1
    for d in name.split(":")[1].split("x"):
        chips *= int(d)
    try:  # one host holds up to 2x2 chips; a 1-chip slice is a 1x1x1 host
        topo = topologies.get_topology_desc(topology_name=name, platform="tpu", chip_config_name="default",
                                            chips_per_host_bounds=(1, 1, 1) if chips == 1 else (2, 2, 1),
                                            num_slices=1, wrap=(False, False, False))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - libtpu's error: an unknown name, or libtpu failing to start
        raise Refused(f"libtpu gave no topology {name!r}: {str(exc).splitlines()[0][:200]}") from exc
    return list(topo.devices)


@contextlib.contextmanager
def patch_for_tpu(hbm_bytes: int) -> Iterator[None]:
    """needle's checks of the runtime backend (the CPU here) answer for the TPU compiled for; undone after."""
    # lazy: jax loads after get_topology_devices has set TPU_ENV
    import jax

    # lazy: the model code imports jax
    from needle.model.decoder import scan

    saved_backend, saved_memory = jax.default_backend, scan.device_memory_bytes
    # needle takes splash attention's Mosaic kernel, not the Pallas interpreter, only where
    # jax.default_backend() is "tpu" (needle/model/decoder/block.py); jax itself asks xla_bridge.
    jax.default_backend = lambda: "tpu"
    # remat "auto" plans for the device's memory (scan.resolve_remat), which the CPU does not report;
    # any needle module holding its own reference to the function is patched alike.
    holders = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("needle.")
               and getattr(m, "device_memory_bytes", None) is saved_memory]  # fmt: skip
    for m in holders:
        m.device_memory_bytes = lambda: hbm_bytes
    try:
        yield
    finally:
        jax.default_backend = saved_backend
        for m in holders:
            m.device_memory_bytes = saved_memory


def make_stem(variant: str, sets: list[str]) -> str:
    """The files' name: the case with its settings and ``--set`` items, safe for a path."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", variant + ("_" + "_".join(sets) if sets else ""))


def find_mosaic_kernels(module: HloModule) -> dict[str, int]:
    """Pallas/Mosaic kernels (``tpu_custom_call``) in the program, by instruction name less its
    ``.N`` suffix: how many call sites each has."""
    names = [re.sub(r"\.\d+$", "", i.name) for c in module.computations.values() for i in c.instrs
             if i.opcode == "custom-call" and i.quoted("custom_call_target") == "tpu_custom_call"]  # fmt: skip
    return dict(sorted(collections.Counter(names).items()))


def summarize_memory(mem: Any, hbm_bytes: int) -> dict[str, Any]:
    """``compiled.memory_analysis()`` as bytes, the HBM need (what bench.accelerator's ``hbm_gb``
    counts) and whether it fits ``hbm_bytes``."""
    need = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    gib = lambda x: round(x / 2**30, 3)  # noqa: E731
    return {"argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            "generated_code_bytes": mem.generated_code_size_in_bytes, "hbm_need_bytes": need,
            "hbm_gb": gib(need), "temp_gb": gib(mem.temp_size_in_bytes), "fits": need <= hbm_bytes}  # fmt: skip


def compile_case(variant: str, overrides: dict[str, Any], device: Any, hbm_bytes: int) -> tuple[dict[str, Any], str]:
    """Compile ``variant`` (a bench.accelerator case, its own settings over ``overrides``) for
    ``device``: (the record, the optimized HLO text)."""
    # lazy: jax loads after get_topology_devices has set TPU_ENV
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    # lazy: the model code imports jax, which loads after get_topology_devices has set TPU_ENV
    from bench.flops import count_matmul_params
    from needle.config import LoraConfig, OptimConfig
    from needle.hardware import settings_for_model
    from needle.model import lora as lora_lib
    from needle.model.decoder.scan import resolve_remat
    from needle.model.decoder.transformer import Transformer
    from needle.model.hf.config import hf_config_to_model_config
    from needle.model.hf.random_model import shape_config
    from needle.train.run import build_state_from_params
    from needle.train.step import count_micro_batches, train_step

    case, own = parse_variant(variant)
    shape, mode, rows, seq = parse_case(case)
    overrides = {**overrides, **own}
    layers = overrides.pop("layers", None)
    cfg = hf_config_to_model_config(shape_config(shape), max_len=seq)
    settings = dataclasses.replace(settings_for_model("tpu", cfg), **overrides)
    if layers is not None:  # after settings_for_model: the whole shape's settings, fewer blocks
        cfg = cut_layers(cfg, layers, case)
    lora_cfg = LoraConfig(rank=16) if mode == "lora" else None
    model = Transformer(cfg, lora_cfg, settings)
    rec: dict[str, Any] = {"variant": variant, "case": case, "shape": shape, "mode": mode, "rows": rows, "seq": seq,
                           "n_layers": cfg.n_layers, "target": device.device_kind, "chip_hbm_gib": hbm_bytes / 2**30,
                           "settings": dataclasses.asdict(settings)}  # fmt: skip
    params_shapes: list[Any] = []

    def build() -> Any:  # run_case's state (needle.train.run.build_state_from_params), traced only
        params = lora_lib.init_params(cfg, lora_cfg, 0, settings)
        params_shapes.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
        return build_state_from_params(params, model, mode, OptimConfig(), 100)[0]

    sharding = SingleDeviceSharding(device)
    with patch_for_tpu(hbm_bytes):
        # the model resolves "auto" per micro-batch (its input's shape); one device here
        rec["micro_batches"] = count_micro_batches(rows, seq, 1, settings.micro_batch_tokens)
        rec["remat_resolved"] = resolve_remat(settings.remat, cfg, rows * seq // rec["micro_batches"], trains_all=mode == "full")
        state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), jax.eval_shape(build))
        batch = {k: jax.ShapeDtypeStruct((rows, seq), dtype, sharding=sharding) for k, dtype in
                 [("inputs", jnp.int32), ("targets", jnp.int32), ("mask", jnp.float32), ("positions", jnp.int32),
                  ("segment_ids", jnp.int32)]}  # fmt: skip
        t0 = time.perf_counter()
        lowered = jax.jit(train_step, donate_argnums=0).lower(state, batch)
        rec["lower_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        compiled = lowered.compile()
        rec["compile_s"] = round(time.perf_counter() - t0, 2)  # this host's, not a TPU host's
    counts = count_matmul_params(params_shapes[0])
    rec["model_flops"] = model_flops(cfg, counts, mode, seq) * rows * seq
    rec["params_m"] = (counts["n_mat"] + cfg.vocab_size * cfg.d_model) / 1e6
    rec["memory"] = summarize_memory(compiled.memory_analysis(), hbm_bytes)
    return rec, compiled.as_text()


def check_overrides(items: list[str]) -> None:
    """Refuse a ``--set`` that is not ``FIELD=VALUE`` of a BackendSettings field with a valid value
    (before compiling, so that a typo is not recorded as a failed compile)."""
    # lazy: needle.hardware imports jax, which loads after get_topology_devices has set TPU_ENV
    from needle.hardware import BackendSettings, settings_for

    fields = {f.name for f in dataclasses.fields(BackendSettings)}
    overrides = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"--set {item!r}: FIELD=VALUE with FIELD one of {sorted(fields)}")
        overrides[key] = parse_value(value)
    dataclasses.replace(settings_for("tpu"), **overrides)  # BackendSettings refuses a bad value


def run(args: argparse.Namespace) -> int:
    if not TOPOLOGY_RE.fullmatch(args.topology):
        raise Refused(f"--topology takes NAME:AxB (v5e:1x1, v5e:2x2), got {args.topology!r}")
    try:
        overrides = {k: parse_value(v) for k, _, v in (item.partition("=") for item in args.set)}
        parse_case(parse_variant(args.case)[0])
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    devices = get_topology_devices(args.topology)
    try:
        check_variant(args.case)  # layers=N on a shape it cannot cut
        check_overrides(args.set)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    kind = devices[0].device_kind
    if args.hbm_gb is None and kind not in HBM_GIB:
        raise Refused(f"no known HBM size for {kind}: give --hbm-gb (what jax reports as bytes_limit, in GiB)")
    hbm_bytes = int((args.hbm_gb or HBM_GIB[kind]) * 2**30)
    print(f"compiling {args.case} for {kind} (topology {args.topology}, {len(devices)} devices; one chip's program)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / make_stem(args.case, args.set)
    try:
        rec, hlo = compile_case(args.case, overrides, devices[0], hbm_bytes)
    except Exception as exc:  # noqa: BLE001 - a program over the chip's memory fails to compile: a result
        rec, hlo = {"variant": args.case, "error": f"{type(exc).__name__}: {str(exc)[:600]}"}, ""
    rec.update(topology=args.topology, set=args.set, date=time.strftime("%Y-%m-%d"))
    if hlo:
        Path(f"{stem}.hlo.txt").write_text(hlo)
        module = parse_hlo(hlo)
        rec["custom_calls"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
        rec["mosaic_kernels"] = find_mosaic_kernels(module)
        if args.cycles:
            report = estimate_cycles(module, dynamic_trip=args.dynamic_trip)
            rec["cycles"] = {**report, "top": report["top"][:TOP]}
            print(format_report(report, TOP))
    Path(f"{stem}.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k not in ("settings", "cycles")}, indent=1))
    print(f"wrote {stem}.json" + (f", {stem}.hlo.txt ({len(hlo) / 1e6:.1f} MB)" if hlo else ""))
    return 1 if "error" in rec else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", help="SIZE-MODE-ROWSxSEQ[|FIELD=VALUE,...], as bench.accelerator (layers=N cuts the shape)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a BackendSettings field over the TPU default, e.g. attention=splash (a case's own after '|' win)")
    ap.add_argument("--topology", default="v5e:1x1", help="libtpu topology name; the program is one chip's")
    ap.add_argument("--hbm-gb", type=float, default=None, metavar="GIB",
                    help="the chip's memory remat 'auto' plans for and the fit is judged against (v5e default 15.75)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "aot"))
    ap.add_argument("--cycles", action="store_true", help="add bench.hlo_cycles's step-time proxy (XLA's estimate)")
    ap.add_argument("--dynamic-trip", type=float, default=2.0,
                    help="trips assumed for a loop of data-dependent bound (the tiled attention's key tiles: "
                         "2.0 for the bench's packed rows at T=1024, 3.0 at T=2048)")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except Refused as exc:
        print(f"bench.aot: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
