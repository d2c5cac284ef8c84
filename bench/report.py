"""Targets (pass/miss), the printed table and the JSON file of a benchmark result dict (bench/run.py, bench/memory.py)."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

# name -> (threshold, direction): ">=" passes at or above, "<=" at or below.
TARGETS: dict[str, tuple[float, str]] = {
    "utilisation.small_lora": (0.30, ">="),
    "utilisation.small_full": (0.30, ">="),
    "utilisation.medium_lora": (0.45, ">="),
    "utilisation.medium_full": (0.45, ">="),
    "needle_style.speedup": (1.3, ">="),
    "cactus.step_throughput_ratio": (2.0, ">="),
    "cactus.wall_ratio": (4.0, ">="),
    "train.small_lora.packing_efficiency": (0.95, ">="),
    "train.small_lora.compiled_shapes": (1, "<="),
    "compile.warm_over_cold": (0.20, "<="),
    "pipeline.mlflow_logging_share": (0.01, "<="),
    "pipeline.flow_overhead_ratio": (0.10, "<="),
}


def _get(result: dict[str, Any], dotted: str) -> Any:
    node: Any = result
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per target: its value (None when not measured) and pass/miss/n/a."""
    out = []
    for name, (threshold, op) in TARGETS.items():
        value = _get(result, "train." + name.split(".", 1)[1] + ".utilisation") if name.startswith("utilisation.") else _get(result, name)
        if not isinstance(value, (int, float)):
            verdict = "n/a"
        else:
            verdict = "pass" if (value >= threshold if op == ">=" else value <= threshold) else "miss"
        out.append({"name": name, "value": value, "threshold": threshold, "op": op, "verdict": verdict})
    return out


def _fmt(x: Any, spec: str = ",.1f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


class _SectionFormatter(string.Formatter):
    """``{a.b:spec}`` prints ``section["a"]["b"]`` through :func:`_fmt` (``-`` when it is missing or
    not a number; no spec means ``,.1f``); the spec ``s`` prints the value as it is."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        return _get(kwargs["section"], field_name), field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        return str(value) if format_spec == "s" else _fmt(value, format_spec or ",.1f")


_SECTION_FORMATTER = _SectionFormatter()

# The line of each single-line section that ran ("ok"), in the table's order (_SectionFormatter's fields).
SECTION_LINES = {
    "compile": "compile (first step): cold {cold.first_step_s} s, warm {warm.first_step_s} s; process start to "
               "first step cold {cold.process_to_first_step_s} s, warm {warm.process_to_first_step_s} s; "
               "step programs cold {cold.programs:s}, warm {warm.programs:s}",
    "needle_style": "needle-style loop: step {step_s:.3f} s, {real_tokens_per_s:,.0f} real tok/s, first step "
                    "{first_step_s} s, ragged step {ragged_step_s} s; ours {speedup:.2f}x",
    "cactus": "cactus-needle finetune_local: step {step_s:.3f} s ({padded_tokens_per_s:,.0f} padded tok/s), "
              "wall {wall_s} s; ours: wall {ours.wall_s} s; ratios: step {step_throughput_ratio:.2f}x, "
              "wall {wall_ratio:.2f}x",
    "data_eval": "data prep: {prep_cold_examples_per_s:,.0f} ex/s cold, {prep_cached_examples_per_s:,.0f} ex/s "
                 "cached; eval decode {eval_decode_tokens_per_s:,.0f} tok/s, {eval_rows_per_s:.2f} rows/s",
}  # fmt: skip


def format_table(result: dict[str, Any]) -> str:
    """A plain-text summary: the limit, each training config, comparisons, targets."""
    lines = []
    peak = result.get("peak", {})
    f32 = peak.get("f32", {}).get("gflops") if isinstance(peak.get("f32"), dict) else None
    lines.append(f"machine: {result['machine'].get('device_kind')} x{result['machine'].get('device_count')}, "
                 f"load {result['machine'].get('loadavg_start')} -> {result['machine'].get('loadavg_end')}")
    lines.append(f"peak f32 matmul {_fmt(f32)} GFLOP/s" + (
        f", bf16 {_fmt(peak['bf16']['gflops'])} GFLOP/s" if isinstance(peak.get("bf16"), dict) else ""))
    lines.append("")
    lines.append(f"{'config':<14}{'step s':>9}{'tok/s pad':>11}{'tok/s real':>11}{'MFLOP/tok':>11}"
                 f"{'GFLOP/s':>9}{'util':>7}{'in-wait':>8}{'T':>6}{'packed':>8}{'shapes':>7}")
    for key, r in result.get("train", {}).items():
        if not isinstance(r, dict) or r.get("status") != "ok":
            lines.append(f"{key:<14}{(r or {}).get('status', '-')}: {(r or {}).get('error', '')[:60]}")
            continue
        lines.append(f"{key:<14}{_fmt(r['step_s'], '.3f'):>9}{_fmt(r['padded_tokens_per_s'], ',.0f'):>11}"
                     f"{_fmt(r['real_tokens_per_s'], ',.0f'):>11}{_fmt(r['flops_per_token']['total'] / 1e6, '.2f'):>11}"
                     f"{_fmt(r['achieved_gflops']):>9}{_fmt(100 * (r.get('utilisation') or 0), '.0f'):>6}%"
                     f"{_fmt(100 * r['input_wait_share'], '.1f'):>7}%"
                     f"{','.join(str(t) for t in r.get('seq_lens', [])):>6}{_fmt(r.get('packing_efficiency'), '.3f'):>8}"
                     f"{_fmt(r.get('compiled_shapes'), 'd'):>7}")
    for key, template in SECTION_LINES.items():
        section = result.get(key, {})
        if section.get("status") == "ok":
            lines.append(_SECTION_FORMATTER.format(template, section=section))
        elif key == "cactus" and section:  # the one section whose failure or skip the table names
            lines.append(f"cactus-needle: {section.get('status')}: {section.get('error') or section.get('reason', '')}"[:300])
    dv = result.get("devices", {})
    if dv.get("status") == "ok":
        lines.append("devices: " + ", ".join(f"{n}: {_fmt(r.get('tokens_per_s'), ',.0f')} tok/s loss {_fmt(r.get('loss'), '.3f')}"
                                             for n, r in dv.get("by_count", {}).items()))
    sv = result.get("serve", {})
    if sv.get("status") == "ok":
        for shape in ("table", "openai"):
            r = sv.get(shape, {})
            lines.append(f"serve {shape:<7}: p50/p95 {_fmt(r.get('latency_p50_s'), '.2f')}/{_fmt(r.get('latency_p95_s'), '.2f')} s, "
                         f"4 clients {_fmt(r.get('concurrent_requests_per_s'), '.1f')} req/s")
        dec = sv.get("decode", {})
        lines.append(f"decode rows/s free {_fmt(dec.get('free_rows_per_s'), '.2f')}, constrained "
                     f"{_fmt(dec.get('constrained_rows_per_s'), '.2f')}")
    lines.append("")
    for t in result.get("targets", []):
        lines.append(f"target {t['name']:<32} {t['op']} {t['threshold']:<6} value {_fmt(t['value'], '.3f'):>8}  {t['verdict']}")
    return "\n".join(lines)


def write_result(result: dict[str, Any], out: str | Path, table: str) -> None:
    """Write ``result`` as JSON to ``out`` (its folder made), then print ``table`` and where it went."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(table)
    print(f"\nwrote {out}")
