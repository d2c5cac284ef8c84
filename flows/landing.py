"""Data arrival: `needle data add FILE` validates rows, lands them in the landing folder, and tells
Prefect, whose deployment trigger (prefect.yaml) starts `needle/finetune` on the folder.

    landed = land(["new_rows.jsonl"], landing_dir())        # validated, copied atomically
    announce(landed, params={"preset": "tiny"})              # event needle.data.landed

A file with a bad row is refused as a whole with ``file:line: reason`` and nothing lands. The copy
is written beside its final name and renamed into place, so a run never reads half a file; its
name carries its content digest, so landing the same rows twice changes nothing. One run at a
time (the deployment's concurrency limit queues the rest): when a run on this folder is already
waiting to start, no event is sent, because that run will read the new file when it starts.
"""

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from needle_flows.paths import state_dir
from needle.data.load import file_digest, source_digest, validate_source
from needle.errors import DataError, DataIssue

EVENT = "needle.data.landed"
RESOURCE = "needle.landing"
DEPLOYMENT = "needle/finetune"


def landing_dir() -> Path:
    """$NEEDLE_LANDING_DIR, or <state dir>/landing."""
    return Path(os.environ.get("NEEDLE_LANDING_DIR") or state_dir() / "landing").resolve()


@dataclass
class Landed:
    """What `land` did: the files written (or already there), the folder and its new digest."""

    folder: Path
    added: list[Path] = field(default_factory=list)
    already: list[Path] = field(default_factory=list)
    rows: int = 0
    digest: str = ""


def land(files: list[str], folder: Path) -> Landed:
    """Validate every file (all or nothing), then copy each into ``folder`` atomically."""
    not_files = [DataIssue(f, 0, "not a file") for f in files if os.path.exists(f) and not os.path.isfile(f)]
    if not_files:
        raise DataError(not_files)
    reports = [(f, validate_source(f)) for f in files]
    issues = [i for _, r in reports for i in r.issues]
    if issues:
        raise DataError(issues)
    folder.mkdir(parents=True, exist_ok=True)
    out = Landed(folder)
    present = {file_digest(str(p)) for p in folder.glob("*.jsonl")}
    for f, report in reports:
        digest = file_digest(f)
        target = folder / f"{Path(f).stem}-{digest[:12]}.jsonl"
        if digest in present:
            out.already.append(target)
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=folder)  # not *.jsonl: unread
        os.close(fd)
        shutil.copyfile(f, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)  # atomic on one filesystem
        present.add(digest)
        out.added.append(target)
        out.rows += report.n_rows
    out.digest = source_digest(str(folder)) or ""
    return out


def waiting_run(folder: Path) -> Optional[str]:
    """The name of a run of needle/finetune on ``folder`` that has not started yet, if any."""
    from datetime import datetime, timedelta, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter
    from prefect.client.schemas.filters import FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(DEPLOYMENT)
        except ObjectNotFound:
            return None  # not deployed: the event is still recorded, nothing waits
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING]))),
        )  # fmt: skip
    soon = datetime.now(timezone.utc) + timedelta(seconds=30)  # not the cron's runs days ahead
    for run in runs:
        data = (run.parameters.get("params") or {}).get("data")
        due = run.expected_start_time is None or run.expected_start_time <= soon
        if due and data and Path(data).resolve() == folder:
            return run.name
    return None


def announce(landed: Landed, params: Optional[dict[str, Any]] = None) -> str:
    """Emit ``needle.data.landed`` for the folder (the deployment trigger passes ``params`` with
    ``data`` set to the folder), unless nothing new landed or a run on it is already waiting.
    Returns what happened, in words."""
    if not landed.added:
        return "nothing new landed: no run started"
    if not os.environ.get("PREFECT_API_URL"):
        return "no Prefect API (PREFECT_API_URL is not set): no run started"
    waiting = waiting_run(landed.folder)
    if waiting is not None:
        return f"run {waiting} is waiting to start on {landed.folder}: it will read the new rows"
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    event = emit_event(
        EVENT,
        resource={"prefect.resource.id": RESOURCE, "prefect.resource.name": str(landed.folder)},
        payload={"params": {**(params or {}), "data": str(landed.folder)}, "files": [str(p) for p in landed.added],
                 "rows": landed.rows, "digest": landed.digest},
    )  # fmt: skip
    EventsWorker.drain_all()  # a short-lived command: deliver before exiting
    return f"event {EVENT} sent ({event.id if event else 'not emitted'}): {DEPLOYMENT} starts on {landed.folder}"
