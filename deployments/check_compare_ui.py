"""Check the MLflow UI's compare view of the two newest runs in a headless browser.

Finds the two newest FINISHED runs of an experiment (or, with ``--parent``, every FINISHED
child run of a sweep's parent run) through the tracking API, checks they share the same param
and metric keys, opens ``#/compare-runs`` in headless Chromium (Debian's
``chromium`` package: ``apt-get install chromium``), and checks the rendered page shows both
runs and shared keys (its tables scroll, so only keys near the top are probed). Writes a
screenshot next to the DOM dump.

    source .state/stack/env.sh
    python deployments/check_compare_ui.py [--experiment needle/finetune] [--out .state/ui-check]
    python deployments/check_compare_ui.py --experiment needle/sweep --parent <parent run id>
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

from mlflow.tracking import MlflowClient


def _chromium(args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        sys.exit("no chromium on PATH: apt-get install chromium")
    base = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1600,1200",
            "--virtual-time-budget=20000", *args, url]
    return subprocess.run(base, capture_output=True, text=True, timeout=180)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="needle/finetune")
    parser.add_argument("--out", default=".state/ui-check")
    parser.add_argument("--parent", default=None, help="compare the finished child runs of this run (a sweep)")
    args = parser.parse_args(argv)
    uri = os.environ["MLFLOW_TRACKING_URI"]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(args.experiment)
    if args.parent:
        runs = client.search_runs([exp.experiment_id], f"attributes.status = 'FINISHED' and "
                                  f"tags.`mlflow.parentRunId` = '{args.parent}'", order_by=["attributes.start_time DESC"])
    else:
        runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=2)
    if len(runs) < 2:
        sys.exit(f"need two finished runs in {args.experiment}, found {len(runs)}")
    a = runs[0]

    def trained(run: object) -> set[str]:  # system/* are sampled every 10 s: present or not by timing
        return {k for k in run.data.metrics if not k.startswith("system/")}

    same_params = all(set(r.data.params) == set(a.data.params) for r in runs)
    same_metrics = all(trained(r) == trained(a) for r in runs) if args.parent else set(a.data.metrics) == set(runs[1].data.metrics)
    ids = [r.info.run_id for r in runs]
    query = urllib.parse.urlencode({"runs": json.dumps(ids), "experiments": json.dumps([exp.experiment_id])})
    url = f"{uri}/#/compare-runs?{query}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dom = _chromium(["--dump-dom"], url).stdout
    (out / "compare.html").write_text(dom)
    _chromium([f"--screenshot={(out / 'compare.png').resolve()}"], url)
    names = [r.info.run_name for r in runs]
    probes = {**{f"run {n}": n for n in names}, "param train.steps": "train.steps", "param lora.rank": "lora.rank",
              "metric base_exact_match": "base_exact_match", "metric base/val_loss": "base/val_loss"}
    if args.parent:  # children carry more metric keys: base_exact_match sorts below the rendered rows
        probes.pop("metric base_exact_match")
        probes["metric base/loss"] = "base/loss"
    shown = {label: text in dom for label, text in probes.items()}
    report = {"url": url, "runs": ids, "same_param_keys": same_params, "same_metric_keys": same_metrics,
              "n_params": len(a.data.params), "n_metrics": len(a.data.metrics), "shown_in_page": shown,
              "screenshot": str(out / "compare.png")}
    print(json.dumps(report, indent=2))
    return 0 if same_params and same_metrics and all(shown.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
