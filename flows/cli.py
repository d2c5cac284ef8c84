"""The `needle` console script: the library's commands (needle.cli) plus `finetune`, the flow.

    needle finetune data/sample/new.jsonl --preset small --base auto   # = make run
    python -m needle_flows.cli finetune DATA [--base DIR] [--steps N] [--params '{"lora": {"rank": 8}}']

`finetune` runs the Prefect flow in-process on Prefect's ephemeral API with Prefect and MLflow
state under .state/ (or $NEEDLE_STATE_DIR). The environment it needs is set here, in the entry
point, before Prefect is imported; importing this module changes nothing.
"""

import os
import sys
from pathlib import Path
from typing import Any, Optional

from needle import cli as needle_cli
from needle.cli import one_line, parse_json_object
from needle.config import preset_names
from needle.errors import UsageError
from needle.eval.report import before_after, format_table
from needle.tracking.redaction import redact_uri
from needle_flows.paths import state_dir, tracking_uri


def add_finetune(sub: Any) -> None:
    """The `finetune` subcommand, for needle.cli's parser."""
    p = sub.add_parser("finetune", help="run the Prefect flow `needle` in-process (embedded default)")
    p.add_argument("data", help="JSONL path, glob or hub id")
    p.add_argument("--preset", choices=preset_names(), default=None, help="model preset of the auto base (default small)")
    p.add_argument("--base", default="auto",
                   help="'auto' (train one), a needle model dir, a Hugging Face model dir, hf:owner/name[@rev] or a .gguf file")
    p.add_argument("--steps", type=needle_cli.positive_int, default=None)
    p.add_argument("--params", default=None, help="further FinetuneParams as a JSON object")
    p.set_defaults(func=_cmd_finetune, own_logging=True)  # Prefect routes needle's log lines


def add_data(sub: Any) -> None:
    """The `data` subcommand group: `needle data add FILE...` (flows/landing.py)."""
    p = sub.add_parser("data", help="data arrival: land validated rows and start a retrain")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    a = data_sub.add_parser("add", help="validate JSONL files, copy them into the landing folder, emit the event")
    a.add_argument("files", nargs="+", help="JSONL files of rows (all refused if any row is bad)")
    a.add_argument("--landing", default=None, help="landing folder (default $NEEDLE_LANDING_DIR or <state>/landing)")
    a.add_argument("--params", default=None, help="further FinetuneParams (JSON) for the run the event starts")
    a.set_defaults(func=_cmd_data_add)


def _cmd_data_add(args: Any) -> int:
    # lazy: landing validates rows with needle.data.load (datasets), only when the command runs
    from needle_flows.landing import announce, land, landing_dir

    overrides = parse_params(args.params)
    folder = Path(args.landing).resolve() if args.landing else landing_dir()
    landed = land(args.files, folder)
    for path in landed.added:
        print(f"landed {path}")
    for path in landed.already:
        print(f"already there {path}")
    print(f"{folder}: {landed.rows} new row(s), folder digest {landed.digest[:16]}")
    print(announce(landed, overrides))
    return 0


def _cmd_finetune(args: Any) -> int:
    overrides = parse_params(args.params)
    params = {"data": args.data, "preset": args.preset, "base_model": args.base, "steps": args.steps, **overrides}
    run_embedded(**params)
    return 0


def parse_params(text: Optional[str]) -> dict[str, Any]:
    """``--params``: a JSON object, or a one-line ``UsageError`` (exit 2)."""
    return parse_json_object(text, "--params") if text else {}


def embedded_env(state: Path, tracking_uri: str) -> dict[str, str]:
    """Environment defaults of an embedded run: Prefect home and MLflow store under ``state``."""
    return {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        # Training progress is logged by the `needle` logger; Prefect forwards it to the run's
        # logs when this is set before Prefect configures logging (prefect.yaml sets it for workers).
        "PREFECT_LOGGING_EXTRA_LOGGERS": "needle",
        "MLFLOW_TRACKING_URI": tracking_uri,
    }


def run_embedded(**params: Any) -> dict[str, Any]:
    """Run the flow in-process with Prefect and MLflow state under .state/ in the checkout."""
    state = state_dir()
    for key, value in embedded_env(state, tracking_uri(state)).items():
        os.environ.setdefault(key, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    # Prefect's logging first: orbax (imported with the library) logs through absl at import,
    # and absl calls logging.basicConfig() when the root logger has no handler yet, after which
    # Prefect's console formatting is lost.
    import prefect.main  # noqa: F401
    from prefect.context import SettingsContext
    from prefect.settings import Settings

    # lazy: these import Prefect, which must see the environment set above first
    from needle_flows import run_record as rec
    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams
    from needle.tracking.mlflow_tracker import check_tracking

    from pydantic import ValidationError

    try:
        p = FinetuneParams(**{k: v for k, v in params.items() if v is not None})
    except ValidationError as exc:
        raise UsageError(f"invalid parameters: {one_line(exc)}") from None
    check_tracking(os.environ["MLFLOW_TRACKING_URI"])  # seconds, before Prefect's server starts
    # Prefect may have read its settings before the environment above was set (an earlier
    # import): settings derived from PREFECT_HOME (the database, result storage) are rebuilt.
    with SettingsContext(profile=SettingsContext.get().profile, settings=Settings()):
        result = needle(p)
    _print_result(result, rec.ui_link)
    return result


def _print_result(result: dict[str, Any], ui_link: Any) -> None:
    uri = redact_uri(result["tracking_uri"])
    print(f"\nMLflow run {result['run_id']} (tracking URI {uri})")
    if result.get("skipped"):
        same = result["same_version"]
        print(f"Decision: {result['decision']} (same inputs as models:/needle/{same['version']}, alias "
              f"{same['alias']}; --params '{{\"force\": true}}' retrains)")
    else:
        mv = result.get("model_version") or {}
        version = mv.get("version")
        print(f"Tuned model: {result['model_dir']}" + (f"  (registered: models:/needle/{version}, alias "
                                                       f"{mv.get('alias')})" if version else ""))
        if result.get("comparison"):
            print("\nBase vs tuned on the test split (free and constrained decoding):")
            print(format_table(before_after(result["comparison"])))
        print(f"Decision: {result.get('decision')}")
    if not uri.startswith("http"):
        print(f"Browse it: mlflow ui --backend-store-uri {uri}  then open "
              f"{ui_link(uri, result['experiment_id'], result['run_id'])}")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `needle` console script."""
    return needle_cli.main(argv, extensions=[add_finetune, add_data])


if __name__ == "__main__":
    sys.exit(main())
