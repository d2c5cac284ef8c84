"""Prefect task: report the JAX backend and devices, and publish the report as an artifact."""

import json
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE


@task(name="probe", cache_policy=NO_CACHE)
def probe() -> dict[str, Any]:
    """Probe the JAX runtime (after data prep: JAX must not start before datasets forks)."""
    from needle.hardware import format_probe, probe as probe_runtime

    info = probe_runtime()
    create_markdown_artifact(
        key="hardware-probe",
        markdown=f"## Hardware probe\n\n```\n{format_probe(info)}\n```\n\n```json\n{json.dumps(info, indent=2)}\n```\n",
        description=f"JAX backend {info['backend']} with {info['device_count']} device(s)",
    )
    return info
