"""The `needle` command line of the library: probe, validate, sample, train, evaluate, predict.

    needle probe [--json]
    needle validate data/sample/new.jsonl
    needle train data/sample/base.jsonl --mode scratch --preset small --out runs/base
    needle evaluate runs/tuned/model data/sample/new.jsonl
    needle predict runs/tuned/model --tools tools.json --query "turn on the kitchen lights"   # [--free]
    needle serve models:/needle@champion --port 5001    # MLflow /invocations + OpenAI /v1/chat/completions

The installed `needle` script is the shell's ``needle_flows.cli:main``, which adds ``finetune`` (the
Prefect flow) to this parser through ``main(argv, extensions)``; ``python -m needle.cli`` is the
library alone. Heavy imports (jax, datasets) happen inside each command so `--help` is fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from needle.config import ClusterConfig, data_config, lora_config, preset_names, training_configs
from needle.data.sample import write_sample
from needle.errors import NeedleError, UsageError
from needle.hardware import format_probe, probe
from needle.registry import resolve_model_dir


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``needle train: error: …``, exit 2) instead of usage + error."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def megabytes(text: str) -> float:
    """argparse type: a size in MB, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of megabytes, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more megabytes, got {text}")
    return value


def parse_json_object(text: str, flag: str) -> dict[str, Any]:
    """``flag``'s value as a JSON object, or a one-line ``UsageError`` (exit 2)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} is not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def one_line(exc: Exception) -> str:
    """A pydantic ValidationError as one line (``loc: message; …``); any other error as its text."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = [f"{'.'.join(str(x) for x in e['loc']) or 'params'}: {e['msg']}" for e in errors()]
    return "; ".join(parts).replace("\n", " ")


def check_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """A directory that can be created or reused: refuse a file (or a file on its path) before any work."""
    out = Path(path)
    for part in (out, *out.absolute().parents):
        if part.exists():
            if not part.is_dir():
                raise UsageError(f"{flag} {out}: {part} is a file, not a directory")
            return out
    return out


def _check_base(mode: str, base: str | None) -> None:
    if mode == "scratch" and base:
        raise UsageError("--mode scratch trains from random init; do not pass --base")
    if mode != "scratch" and not base:
        raise UsageError(f"--mode {mode} needs --base (a model directory or hf:owner/name; train one with --mode scratch)")
    if base and not base.startswith("hf:") and not Path(base).exists():
        raise UsageError(f"--base {base}: no such model directory or file")


def _cmd_probe(args: argparse.Namespace) -> int:
    info = probe()
    print(json.dumps(info, sort_keys=True) if args.json else format_probe(info))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    # lazy: the command's stage (jax, datasets) loads only when it runs, so `needle --help` stays fast
    from needle.data.load import format_validation, validate_source

    worst = 0
    for source in args.paths:
        report = validate_source(source)
        print(format_validation(report, limit=args.limit))
        worst = worst or (0 if report.ok else 1)
    return worst


def _cmd_sample(args: argparse.Namespace) -> int:
    paths = write_sample(args.out_dir, seed=args.seed)
    for part, path in paths.items():
        print(f"{part}: {path}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    # lazy: the command's stage (jax, datasets) loads only when it runs, so `needle --help` stays fast
    from needle import pipeline

    scratch = args.mode == "scratch"
    _check_base(args.mode, args.base)  # argument mistakes fail before any file is read or written
    train = parse_json_object(args.train, "--train") if args.train else None
    optim = parse_json_object(args.optim, "--optim") if args.optim else None
    try:
        train_cfg, optim_cfg = training_configs(args.mode, steps=args.steps, batch_size=args.batch_size,
                                                seed=args.seed, train=train, optim=optim)  # fmt: skip
    except ValueError as exc:  # pydantic's ValidationError: an unknown key or a bad value
        raise UsageError(f"--train/--optim: {one_line(exc)}") from None
    out = check_out_dir(args.out)
    source = pipeline.load_data(args.data, args.on_error)  # bad rows fail before any model loads
    base = None if scratch else pipeline.obtain_base(args.base, preset=args.preset, max_len=args.max_len)
    model_cfg = pipeline.model_config(args.preset) if base is None else base.model_cfg
    data_cfg = data_config(args.data, model_cfg, args.max_len, args.on_error)
    prepared = pipeline.prepare_data(data_cfg, source, tokenizer=base.tokenizer if base else None,
                                     vocab_size=model_cfg.vocab_size, cache_dir=prepared_cache_dir())
    lora_cfg = lora_config(args.mode, {k: v for k, v in (('rank', args.lora_rank), ('alpha', args.lora_alpha),
                                                          ('targets', args.lora_targets)) if v is not None})
    cluster = ClusterConfig(workers=args.workers, address=args.ray, devices_per_worker=args.devices_per_worker)
    trained = pipeline.train(prepared, model_cfg, train_cfg, optim_cfg, lora_cfg, base=base, out_dir=out,
                             cluster=cluster)  # fmt: skip
    summary = _train_summary(trained, prepared, args.mode, model_cfg.preset)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def prepared_cache_dir() -> Path:
    """Where `needle train` keeps prepared data, by content key: ``$NEEDLE_CACHE_DIR/prepared``
    (default ``~/.cache/needle``), outside ``--out``, so a refused resume leaves ``--out`` as it was."""
    return Path(os.environ.get("NEEDLE_CACHE_DIR") or Path.home() / ".cache" / "needle") / "prepared"


def _train_summary(trained: Any, prepared: Any, mode: str, preset: str) -> dict[str, Any]:
    """What `needle train` prints and writes to summary.json."""
    keys = ("model_dir", "train_loss", "val_loss", "wall_s", "tokens_per_s")
    return {
        **{k: getattr(trained, k) for k in keys}, "fingerprint": prepared.fingerprint, "mode": mode, "preset": preset,
        "steps": trained.final_step,
        "data_stats": prepared.data.stats, "prepared_dir": str(prepared.directory),
    }  # fmt: skip


def _cmd_export(args: argparse.Namespace) -> int:
    # lazy: the command's stage (jax, datasets) loads only when it runs, so `needle --help` stays fast
    from needle.model.export import export_model

    if args.format == "gguf":  # the model file and, for a LoRA run, the adapter file: one path a line
        from needle.model.gguf.export import export_gguf  # lazy, as export_model

        for path in export_gguf(resolve_model_dir(args.model), args.out, args.type or "f16"):
            print(path)
        return 0
    if args.type is not None:
        raise UsageError("--type applies to --format gguf only")
    print(export_model(args.model, args.format, args.out))
    return 0


def _cmd_sample_model(args: argparse.Namespace) -> int:
    # lazy: the command's stage (jax, datasets) loads only when it runs, so `needle --help` stays fast
    from needle.model.hf.random_model import parse_shape, write_random_hf_model

    if args.arch == "needle3":
        from needle.model.needle3.random_model import SHAPES, write_random_needle3  # lazy, as above

        shape = args.shape or "tiny"
        print(write_random_needle3(args.out_dir, data=args.data, seed=args.seed,
                                   shape=shape if shape in SHAPES else parse_shape(shape) or {}))  # fmt: skip
        return 0
    print(write_random_hf_model(args.out_dir, args.arch, data=args.data, vocab_size=args.vocab_size, seed=args.seed,
                                shape=args.shape))  # fmt: skip
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    # lazy: the command's stage (jax, datasets) loads only when it runs, so `needle --help` stays fast
    from needle.serve.predict import run_evaluate_cli

    if args.out is not None:
        check_out_dir(args.out)  # before the evaluation runs, not after
    return run_evaluate_cli(args.checkpoint, args.data, args.out, args.max_rows, constrained=not args.free_only)


def _cmd_serve(args: argparse.Namespace) -> int:
    # lazy: the command's stage (jax, datasets) loads only when it runs, so `needle --help` stays fast
    from needle.model.gguf.reader import is_gguf_file
    from needle.serve.engine import PREFIX_CACHE_ENV
    from needle.serve.http import serve

    if args.prefix_cache_mb is not None:
        os.environ[PREFIX_CACHE_ENV] = str(args.prefix_cache_mb)  # read where the pyfunc builds its Predictor
    model = args.model
    if is_gguf_file(model):  # a llama.cpp file: served as the needle model directory it imports to
        from needle.model.io import gguf_model_dir  # lazy, as above

        model = str(gguf_model_dir(model, prepared_cache_dir().parent / "gguf"))
    serve(model, host=args.host, port=args.port)
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    # lazy: the command's stage (jax, datasets) loads only when it runs, so `needle --help` stays fast
    from needle.serve.predict import run_predict_cli

    queries = [args.query] if args.query is not None else _stdin_queries()
    return run_predict_cli(args.checkpoint, args.tools, queries, constrained=not args.free)


def _stdin_queries() -> list[str]:
    if not hasattr(sys.stdin, "buffer"):  # a replaced (text) stdin, as in tests
        return [line.rstrip("\n") for line in sys.stdin if line.strip()]
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UsageError(f"stdin line {line} is not valid UTF-8 (byte 0x{data[exc.start]:02x})") from None
    return [line.rstrip("\r") for line in text.split("\n") if line.strip()]


Extension = Callable[[Any], None]  # adds subcommands to the parser's subparsers action


def build_parser(extensions: Sequence[Extension] = ()) -> argparse.ArgumentParser:
    """The argument parser of every subcommand, plus those the ``extensions`` add."""
    parser = _Parser(prog="needle", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_data_commands(sub)
    _add_model_commands(sub)
    for extend in extensions:
        extend(sub)
    return parser


def _add_data_commands(sub: Any) -> None:
    p = sub.add_parser("probe", help="report the JAX backend and devices")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a report")
    p.set_defaults(func=_cmd_probe)

    p = sub.add_parser("validate", help="check every row of tool-calling JSONL files")
    p.add_argument("paths", nargs="+", help="JSONL files or globs")
    p.add_argument("--limit", type=positive_int, default=20, help="bad rows to list before the total")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("sample", help="write the synthetic sample dataset (base and new tools)")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_sample)

    p = sub.add_parser("sample-model", help="write a random Hugging Face model or Needle 3 base (demos and tests, offline)")
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=["qwen3", "qwen2", "llama", "gemma3_text", "needle3"], default="qwen3",
                   help="needle3: checkpoints/needle3.safetensors + tokenizer/tokenizer.model, as the hub repository")
    p.add_argument("--data", default=None, help="JSONL rows to train its tokenizer on")
    p.add_argument("--vocab-size", type=positive_int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default=None, help="a real model's shape with random weights: smollm2-135m, qwen3-0.6b, "
                   "gemma3-270m, or config.json keys as key=value,... (sets the model's vocab_size and size); "
                   "needle3: tiny (default), needle3 (cactus-needle 3.2.8's defaults) or TransformerConfig keys")
    p.set_defaults(func=_cmd_sample_model)


def _add_model_commands(sub: Any) -> None:
    p = sub.add_parser("train", help="train with the library only (no Prefect, no MLflow)")
    p.add_argument("data", help="JSONL path, glob or hub id")
    p.add_argument("--out", required=True, help="output directory (prepared data, checkpoints, model)")
    p.add_argument("--mode", choices=["lora", "full", "scratch"], default="lora")
    p.add_argument("--preset", choices=preset_names(), default=None,
                   help="model preset (scratch: default small; lora/full: must match the base's)")
    p.add_argument("--base", default=None,
                   help="base model (lora/full): a needle model dir, a Hugging Face model dir, hf:owner/name[@rev] or a .gguf file")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="longest tokenized row, and an imported model's context (default: the model's; "
                   "2048 for an imported one, capped by the model)")
    p.add_argument("--lora-rank", type=positive_int, default=None, help="adapter rank (mode lora; default 16)")
    p.add_argument("--lora-alpha", type=float, default=None, help="adapter scale numerator (mode lora; default 32)")
    p.add_argument("--lora-targets", type=lambda s: tuple(s.split(",")), default=None, metavar="q,k,v,...",
                   help="projections that get an adapter (mode lora; default q,k,v,o,gate,up,down)")
    p.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default: the mode's)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (default: the mode's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--on-error", choices=["fail", "drop"], default="fail", help="bad rows: fail, or drop and report")
    p.add_argument("--train", default=None, metavar="JSON",
                   help='TrainConfig keys, as the flow\'s `train` parameter (e.g. \'{"scan_layers": true}\')')
    p.add_argument("--optim", default=None, metavar="JSON",
                   help='OptimConfig keys, as the flow\'s `optim` parameter (e.g. \'{"lr": 1e-4}\')')
    p.add_argument("--workers", type=positive_int, default=1,
                   help="train as one program on N Ray workers (default 1: in this process)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="the Ray cluster for --workers (default: a local one started and stopped for the run)")
    p.add_argument("--devices-per-worker", type=positive_int, default=1,
                   help="devices each worker trains on (GPUs; on CPU, virtual devices)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("evaluate", help="score the tool calls a model emits on a dataset")
    p.add_argument("checkpoint", help="exported model directory, models:/needle/<version> or a .gguf file")
    p.add_argument("data", help="JSONL path or glob")
    p.add_argument("--out", default=None, help="report directory (default: <checkpoint>/../eval)")
    p.add_argument("--max-rows", type=positive_int, default=None)
    p.add_argument("--free-only", action="store_true",
                   help="skip the constrained decode (default: report free and constrained decoding side by side)")
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser("predict", help="print the tool calls for a query (or stdin, one per line)")
    p.add_argument("checkpoint", help="exported model directory, models:/needle/<version> or a .gguf file")
    p.add_argument("--tools", required=True, help="JSON file with the list of tools")
    p.add_argument("--query", default=None, help="the query (default: read stdin)")
    p.add_argument("--free", action="store_true",
                   help="decode freely (default: constrained to the offered tools' schemas, needle/eval/constrain.py)")
    p.set_defaults(func=_cmd_predict)

    p = sub.add_parser("serve", help="serve a model over HTTP: MLflow's /invocations and OpenAI's /v1/chat/completions")
    p.add_argument("model", help="models:/needle@champion, runs:/ID/model, an MLflow model dir, a needle model dir "
                                 "or a .gguf file (imported once into $NEEDLE_CACHE_DIR/gguf)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=positive_int, default=5123, help="default 5123 (5000 is the MLflow UI's)")
    p.add_argument("--prefix-cache-mb", type=megabytes, default=None,
                   help="keys and values of shared prompt prefixes kept for reuse, in MB (default "
                        "$NEEDLE_PREFIX_CACHE_MB or 256; 0: off)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("export", help="write a model as a Hugging Face model, a PEFT LoRA adapter or Needle's files")
    p.add_argument("model", help="needle model dir, models:/needle@champion, a Hugging Face model dir or a .gguf file")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", choices=["hf", "peft", "needle", "gguf"], default="hf",
                   help="needle (Needle 3 models): checkpoint.safetensors, adapter.safetensors, model.cact; "
                        "gguf (llama.cpp): OUT/model.gguf and, for a LoRA run, OUT/adapter.gguf (OUT may be FILE.gguf)")
    p.add_argument("--type", choices=["f16", "bf16", "q8_0", "f32"], default=None,
                   help="GGUF tensor type of the matrices (default f16; norms stay f32)")
    p.set_defaults(func=_cmd_export)


def main(argv: Sequence[str] | None = None, extensions: Sequence[Extension] = ()) -> int:
    """Run one command; bad input (a ``NeedleError``) exits 2 with the reason on stderr.

    A command whose parser sets ``own_logging`` (the flow: Prefect routes needle's log lines)
    configures logging itself.
    """
    args = build_parser(extensions).parse_args(argv)
    if not getattr(args, "own_logging", False):
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        logging.getLogger("needle").setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except NeedleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
