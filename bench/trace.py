"""Where the device time of a traced run goes: the ops of a Perfetto trace, summed by name.

``python -m bench.accelerator --profile DIR`` writes one ``jax.profiler.trace`` per case (and per
decoding kind) under DIR; this reads each ``perfetto_trace.json.gz`` below a path and prints,
per trace, the device's XLA modules (one line per compiled program: calls, total ms) and its
XLA ops summed by name (calls, total ms, share of the device's busy time), with the op's
framework name or HLO text where the trace carries one, so a fusion can be traced to the code.

    python -m bench.trace DIR [--top 25] [--json FILE]

A trace without a device process (a CPU run) is summarised from its XLA host threads instead.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

DETAIL_KEYS = ("tf_op", "long_name", "hlo_op", "source", "name")


def load_events(path: Path) -> tuple[list[dict[str, Any]], dict[int, str], dict[tuple[int, int], str]]:
    """The complete events of a trace and the names of its processes and threads."""
    data = json.loads(gzip.decompress(path.read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid", 0))] = e["args"]["name"]
    return [e for e in events if e.get("ph") == "X"], procs, threads


def _detail(args: dict[str, Any]) -> str:
    for key in DETAIL_KEYS:
        if args.get(key):
            return f"{key}={str(args[key])[:150]}"
    return ""


def summarise(path: Path, top: int = 25) -> dict[str, Any]:
    """Per-module and per-op device time of one trace (ms), largest first."""
    events, procs, threads = load_events(path)
    device = {pid for pid, name in procs.items() if "TPU" in name or "GPU" in name}
    if device:
        pick = lambda e, kind: e["pid"] in device and kind in threads.get((e["pid"], e.get("tid", 0)), "")  # noqa: E731
        ops = [e for e in events if pick(e, "XLA Ops")]
        modules = [e for e in events if pick(e, "XLA Modules")]
    else:  # a CPU trace: XLA's work runs on its client and Eigen threads
        ops = [e for e in events if "XLA" in threads.get((e["pid"], e.get("tid", 0)), "")]
        modules = []
    by_module: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in modules:
        by_module[e["name"]][0] += 1
        by_module[e["name"]][1] += e.get("dur", 0.0) / 1e3
    by_op: dict[str, list[Any]] = defaultdict(lambda: [0, 0.0, ""])
    for e in ops:
        rec = by_op[e["name"]]
        rec[0] += 1
        rec[1] += e.get("dur", 0.0) / 1e3
        rec[2] = rec[2] or _detail(e.get("args", {}))
    busy = sum(r[1] for r in by_op.values()) or 1.0
    span = (max(e["ts"] + e.get("dur", 0) for e in ops) - min(e["ts"] for e in ops)) / 1e3 if ops else 0.0
    return {
        "trace": str(path),
        "device_busy_ms": busy,
        "span_ms": span,
        "modules": sorted(([k, v[0], v[1]] for k, v in by_module.items()), key=lambda r: -r[2]),
        "ops": sorted(([k, v[0], v[1], v[1] / busy, v[2]] for k, v in by_op.items()), key=lambda r: -r[2])[:top],
        "n_ops": len(ops),
        "op_arg_keys": sorted({k for e in ops[:2000] for k in e.get("args", {})}),
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"== {s['trace']}", f"device busy {s['device_busy_ms']:.1f} ms over a span of {s['span_ms']:.1f} ms, "
             f"{s['n_ops']} op events; op args: {', '.join(s['op_arg_keys'])}"]  # fmt: skip
    for name, calls, ms in s["modules"][:8]:
        lines.append(f"  module {name[:60]:<60} {calls:>6} calls {ms:>10.2f} ms")
    for name, calls, ms, share, detail in s["ops"]:
        lines.append(f"  {name[:40]:<40} {calls:>6} {ms:>9.2f} ms {share:>6.1%}  {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a perfetto_trace.json.gz or a directory holding some")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    files = [args.path] if args.path.is_file() else sorted(args.path.rglob("*perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"{args.path}: no perfetto_trace.json.gz below it")
    summaries = [summarise(f, args.top) for f in files]
    for s in summaries:
        print(format_summary(s))
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
