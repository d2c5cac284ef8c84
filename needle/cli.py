"""The `needle` command line: probe, validate, sample, prepare, train, finetune, evaluate, predict.

    needle probe [--json]
    needle validate data/sample/new.jsonl
    needle train data/sample/base.jsonl --mode scratch --preset small --out runs/base
    needle finetune data/sample/new.jsonl --preset small --base auto     # the embedded Prefect flow
    needle evaluate runs/tuned/model data/sample/new.jsonl
    needle predict runs/tuned/model --tools tools.json --query "turn on the kitchen lights"

Heavy imports (jax, datasets, prefect) happen inside each command so `needle --help` is fast.
"""

from __future__ import annotations

import argparse
import logging
import json
import sys
from collections.abc import Sequence

from needle.config import preset_names


def _cmd_probe(args: argparse.Namespace) -> int:
    from needle.hardware import format_probe, probe

    info = probe()
    print(json.dumps(info, sort_keys=True) if args.json else format_probe(info))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from needle.data.load import format_validation, validate_source

    worst = 0
    for source in args.paths:
        report = validate_source(source)
        print(format_validation(report, limit=args.limit))
        worst = worst or (0 if report.ok else 1)
    return worst


def _cmd_sample(args: argparse.Namespace) -> int:
    from needle.data.sample import write_sample

    paths = write_sample(args.out_dir, seed=args.seed)
    for part, path in paths.items():
        print(f"{part}: {path}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from needle.recipe import train_from_source

    result = train_from_source(
        args.data,
        out_dir=args.out,
        mode=args.mode,
        preset=args.preset,
        base_model_dir=args.base,
        steps=args.steps,
        seed=args.seed,
    )
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _cmd_finetune(args: argparse.Namespace) -> int:
    # The shell, not the core: this command runs the Prefect flow in-process (embedded API).
    from flows.finetune import run_embedded

    overrides = json.loads(args.params) if args.params else {}
    params = {"data": args.data, "preset": args.preset, "base_model": args.base, **overrides}
    if args.steps is not None:
        params["steps"] = args.steps
    run_embedded(**params)
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from needle.eval.predict import run_evaluate_cli

    return run_evaluate_cli(args.checkpoint, args.data, args.out, args.max_rows)


def _cmd_predict(args: argparse.Namespace) -> int:
    from needle.eval.predict import run_predict_cli

    queries = [args.query] if args.query else [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return run_predict_cli(args.checkpoint, args.tools, queries)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="needle", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("probe", help="report the JAX backend and devices")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a report")
    p.set_defaults(func=_cmd_probe)

    p = sub.add_parser("validate", help="check every row of tool-calling JSONL files")
    p.add_argument("paths", nargs="+", help="JSONL files or globs")
    p.add_argument("--limit", type=int, default=20, help="bad rows to list before the total")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("sample", help="write the synthetic sample dataset (base and new tools)")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_sample)

    p = sub.add_parser("train", help="train with the library only (no Prefect, no MLflow)")
    p.add_argument("data", help="JSONL path, glob or hub id")
    p.add_argument("--out", required=True, help="output directory (checkpoints, model)")
    p.add_argument("--mode", choices=["lora", "full", "scratch"], default="lora")
    p.add_argument("--preset", choices=preset_names(), default="small")
    p.add_argument("--base", default=None, help="exported base model directory (lora/full)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("finetune", help="run the Prefect flow `needle` in-process (embedded default)")
    p.add_argument("data", help="JSONL path, glob or hub id")
    p.add_argument("--preset", choices=preset_names(), default="small")
    p.add_argument("--base", default="auto", help="exported base model dir, or 'auto' to train one")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--params", default=None, help="extra flow parameters as a JSON object")
    p.set_defaults(func=_cmd_finetune)

    p = sub.add_parser("evaluate", help="score the tool calls a model emits on a dataset")
    p.add_argument("checkpoint", help="exported model directory or models:/needle/<version>")
    p.add_argument("data", help="JSONL path or glob")
    p.add_argument("--out", default=None, help="report directory (default: <checkpoint>/../eval)")
    p.add_argument("--max-rows", type=int, default=None)
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser("predict", help="print the tool calls for a query (or stdin, one per line)")
    p.add_argument("checkpoint", help="exported model directory or models:/needle/<version>")
    p.add_argument("--tools", required=True, help="JSON file with the list of tools")
    p.add_argument("--query", default=None, help="the query (default: read stdin)")
    p.set_defaults(func=_cmd_predict)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `needle` console script."""
    from needle.errors import NeedleError

    args = build_parser().parse_args(argv)
    if args.command != "finetune":  # the flow routes needle's log lines through Prefect's logging
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        logging.getLogger("needle").setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except NeedleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
