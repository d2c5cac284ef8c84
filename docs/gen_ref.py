"""Generate the reference pages from the code, so they cannot drift from it.

Run by MkDocs as a hook (mkdocs.yml ``hooks:``): before the build reads the pages it adds

- ``reference/configuration.md``: every pydantic config (needle/config.py, needle/gate.py,
  flows/params.py, flows/sweep.py) with each field's type, default and description, the model
  presets and the per-mode training defaults;
- ``reference/cli.md``: every ``needle`` command and option, from the argument parser the
  console script builds (needle/cli.py ``build_parser`` plus flows/cli.py's commands);
- ``reference/benchmark-results.md``: the latest benchmark tables, from bench/results/*.json.

A field without a description, or a command without help, fails the build. Standalone, it
writes the pages to a folder for a look: ``python docs/gen_ref.py /tmp/ref``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (module, classes in reading order); every BaseModel of a module must be listed (checked).
CONFIG_MODULES = {
    "needle.config": ["ModelConfig", "RopeScaling", "Needle3Config", "LoraConfig", "OptimConfig", "TrainConfig",
                      "DataConfig", "EvalConfig", "ClusterConfig"],
    "needle.gate": ["GateRule"],
    "needle_flows.params": ["FinetuneParams"],
    "needle_flows.sweep": ["SweepParams", "Dimension"],
}
# Classes whose fields carry no description yet (their docstring says what they are); any other
# field without one fails the build. Remove an entry once its fields are described.
UNDESCRIBED_OK = {"needle_flows.sweep.Dimension"}


class ReferenceError(Exception):
    """The code lacks what the reference needs (a description, a help text)."""


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type_name(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    text = json.dumps(value, default=lambda o: o.model_dump(mode="json") if hasattr(o, "model_dump") else str(o))
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def config_page() -> str:
    import importlib

    from pydantic import BaseModel

    from needle.config import MODE_DEFAULTS, model_preset, preset_names

    out = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models' field descriptions by `docs/gen_ref.py` at every build: it",
        "cannot drift from the code. Every config rejects unknown keys, so a misspelt key is an error.",
        "Flow parameters (`FinetuneParams`) nest the library configs: `lora`, `optim`, `train`, `eval`,",
        "`gate` take the keys of `LoraConfig`, `OptimConfig`, `TrainConfig`, `EvalConfig`, `GateRule`.",
        "",
        "## Model presets",
        "",
        "`--preset NAME` (`preset` in the flow) picks one; an imported base brings its own config instead.",
        "",
        "| preset | vocab | d_model | layers | heads | kv heads | d_ff | max_len |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in preset_names():
        c = model_preset(name)
        out.append(f"| `{name}` | {c.vocab_size} | {c.d_model} | {c.n_layers} | {c.n_heads} | {c.n_kv_heads} "
                   f"| {c.d_ff} | {c.max_len} |")
    out += ["", "## Training defaults per mode", "",
            "`needle.config.MODE_DEFAULTS`, merged by `training_configs()` (the one place overrides merge:",
            "`needle train`, the flow and the `auto` base).", "",
            "| mode | train | optim |", "| --- | --- | --- |"]
    for mode, d in MODE_DEFAULTS.items():
        out.append(f"| `{mode}` | `{json.dumps(d['train'])}` | `{json.dumps(d['optim'])}` |")
    missing: list[str] = []
    for module_name, names in CONFIG_MODULES.items():
        module = importlib.import_module(module_name)
        declared = {n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, BaseModel)
                    and v.__module__ == module_name and not n.startswith("_")}
        if declared - set(names):
            raise ReferenceError(f"{module_name}: add {sorted(declared - set(names))} to CONFIG_MODULES in docs/gen_ref.py")
        out += ["", f"## `{module_name}`"]
        for name in names:
            cls = getattr(module, name)
            doc = inspect.cleandoc(cls.__doc__ or "")
            out += ["", f"### {name}", ""]
            if doc:
                out += [doc, ""]
            out += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
            for field_name, field in cls.model_fields.items():
                if not field.description and f"{module_name}.{name}" not in UNDESCRIBED_OK:
                    missing.append(f"{module_name}.{name}.{field_name}")
                out.append(f"| `{field_name}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} "
                           f"| {_cell(field.description or '')} |")
    if missing:
        raise ReferenceError("fields without a description: " + ", ".join(missing))
    return "\n".join(out) + "\n"


def _walk(parser: argparse.ArgumentParser, path: list[str], out: list[str], missing: list[str]) -> None:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {c.dest: c.help for s in subs for c in s._choices_actions}
    for sub in subs:
        for name, child in sub.choices.items():
            full = path + [name]
            help_text = helps.get(name)
            if not help_text:
                missing.append(" ".join(full))
            out += ["", f"## `{' '.join(full)}`", "", help_text or "", "", "```text",
                    child.format_usage().strip().replace("usage: ", ""), "```"]
            rows = []
            for action in child._actions:
                if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                    continue
                flag = ", ".join(action.option_strings) or action.dest
                default = "" if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings \
                    else f"`{action.default}`"
                choices = f" (one of {', '.join(map(str, action.choices))})" if action.choices else ""
                rows.append(f"| `{flag}` | {_cell((action.help or '') + choices)} | {default} |")
            if rows:
                out += ["", "| argument | meaning | default |", "| --- | --- | --- |", *rows]
            _walk(child, full, out, missing)


def cli_page() -> str:
    from needle_flows.cli import add_data, add_finetune
    from needle.cli import build_parser

    parser = build_parser(extensions=[add_finetune, add_data])
    out = [
        "# CLI reference",
        "",
        "Generated from the `needle` console script's argument parser (`needle.cli.build_parser` plus the",
        "`finetune` and `data` commands of `flows/cli.py`) by `docs/gen_ref.py` at every build.",
        "Every command exits 2 with one line on stderr for a usage mistake; `needle COMMAND --help` prints",
        "the same text.",
        "",
        "```text",
        parser.format_usage().strip().replace("usage: ", ""),
        "```",
    ]
    missing: list[str] = []
    _walk(parser, ["needle"], out, missing)
    if missing:
        raise ReferenceError("commands without help: " + ", ".join(missing))
    return "\n".join(out) + "\n"


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 10:
        value = int(value)
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def benchmark_page() -> str:
    results = ROOT / "bench" / "results"
    latest = results / "latest.json"
    out = ["# Latest benchmark results", "",
           "Generated from `bench/results/latest.json` (written by `make bench`) by `docs/gen_ref.py` at every",
           "build. How to run it and how to read it: [Performance](../performance.md); every key:",
           "[Benchmark JSON](../benchmark.md)."]
    if not latest.is_file():
        return "\n".join(out + ["", "No `bench/results/latest.json` in this checkout: run `make bench`."]) + "\n"
    d = json.loads(latest.read_text(encoding="utf-8"))
    m = d.get("machine", {})
    out += ["", f"**Run {d.get('created', '?')}** on `{m.get('backend')}` "
            f"({m.get('device_count')} device, {m.get('cpu_count')} CPU cores, jax {m.get('jax_version')}), "
            f"load average {m.get('loadavg_start')} at the start and {m.get('loadavg_end')} at the end"
            + (", quick mode" if d.get("quick") else "") + "."]
    peak = d.get("peak", {}).get("f32", {})
    if peak.get("gflops"):
        out += ["", f"Measured peak (best float32 {peak.get('n')}x{peak.get('n')} matmul): "
                f"{_fmt(peak['gflops'], 1)} GFLOP/s (median {_fmt(peak.get('gflops_median'), 1)})."]
    train = {k: v for k, v in d.get("train", {}).items() if isinstance(v, dict) and v.get("status") == "ok"}
    if train:
        out += ["", "## Training step", "",
                "| config | step s | real tokens/s | GFLOP/s | utilisation | input wait | seq len | packing efficiency |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, t in train.items():
            out.append(f"| `{name}` | {_fmt(t.get('step_s'))} | {_fmt(round(t.get('real_tokens_per_s') or 0))} "
                       f"| {_fmt(t.get('achieved_gflops'), 1)} | {_fmt(100 * (t.get('utilisation') or 0), 1)} % "
                       f"| {_fmt(100 * (t.get('input_wait_share') or 0), 1)} % | {_fmt(t.get('seq_len', t.get('mean_seq_len')))} "
                       f"| {_fmt(t.get('packing_efficiency'))} |")
    targets = d.get("targets") or []
    if targets:
        out += ["", "## Targets", "", "| target | threshold | value | verdict |", "| --- | --- | ---: | --- |"]
        for t in targets:
            out.append(f"| `{t.get('name')}` | {t.get('op')} {t.get('threshold')} | {_fmt(t.get('value'))} "
                       f"| {t.get('verdict')} |")
    serve = d.get("serve") or {}
    if serve.get("status") == "ok" or "table" in serve:
        out += ["", "## Serving", "", "| measure | table shape, `/invocations` | OpenAI client, `/v1/chat/completions` |",
                "| --- | ---: | ---: |"]
        t, o = serve.get("table", {}), serve.get("openai", {})
        for key, label in [("latency_p50_s", "one client, latency p50 (s)"), ("latency_p95_s", "one client, latency p95 (s)"),
                           ("concurrent_requests_per_s", "4 clients, requests/s"),
                           ("concurrent_latency_p50_s", "4 clients, latency p50 (s)"),
                           ("concurrent_latency_p95_s", "4 clients, latency p95 (s)")]:
            out.append(f"| {label} | {_fmt(t.get(key), 2)} | {_fmt(o.get(key), 2)} |")
        dec = serve.get("decode", {})
        if dec:
            out += ["", f"Decoding in process ({dec.get('rows')} rows, warm): {_fmt(dec.get('free_rows_per_s'), 1)} rows/s "
                    f"free, {_fmt(dec.get('constrained_rows_per_s'), 1)} rows/s constrained."]
    if d.get("reruns"):
        out += ["", "## Sections re-run after the main run", ""]
        out += [f"- `{k}`: {v}" for k, v in d["reruns"].items()]
    return "\n".join(out) + "\n"


PAGES = {
    "reference/configuration.md": config_page,
    "reference/cli.md": cli_page,
    "reference/benchmark-results.md": benchmark_page,
}


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the build (nothing is written into docs/)."""
    from mkdocs.structure.files import File

    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    return files


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "site-ref")
    for uri, make in PAGES.items():
        path = target / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make(), encoding="utf-8")
        print(path)
