"""What the distribution installs: `needle`, `needle_flows` and `needle_tasks`, never top-level
`flows` or `tasks`, so another distribution's packages of those generic names and needle live
side by side.

    python -m pytest tests/test_packaging.py -q
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_and_the_shell_installs_under_needle_names() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "needle").rglob("__init__.py")}
    data_only = {"needle.data.templates"}  # the chat templates, shipped by package-data
    assert all(any((ROOT / d.replace(".", "/")).glob("*.jinja")) for d in data_only)
    assert set(setuptools["packages"]) == on_disk | data_only | {"needle_flows", "needle_tasks"}
    assert setuptools["package-dir"] == {"needle_flows": "flows", "needle_tasks": "tasks"}
    top_level = importlib.metadata.distribution("needle").read_text("top_level.txt")
    assert top_level is not None and set(top_level.split()) == {"needle", "needle_flows", "needle_tasks"}


def test_needle_runs_beside_another_distributions_tasks_and_flows(tmp_path: Path) -> None:
    # Another distribution's `tasks` and `flows`, first on the path, and a working directory
    # outside the checkout (so the repository's own folders are not on the path either).
    for name in ("tasks", "flows"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("OTHER = True\n", encoding="utf-8")
    code = ("import needle_flows.finetune, needle_flows.sweep, needle_tasks.stages, tasks, flows; "
            "assert tasks.OTHER and flows.OTHER; "
            "from needle_flows.cli import main; main(['--help'])")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "finetune" in out.stdout and "serve" in out.stdout


def test_the_gguf_extra_brings_llama_cpps_openai_server() -> None:
    # docs/models.md runs `python -m llama_cpp.server` on an export; without [server] it fails on import.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert any(r.startswith("llama-cpp-python[server]==") for r in extras["gguf"])
    pinned = {line.split("==")[0] for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").split()}
    assert {"sse-starlette", "starlette-context"} <= pinned  # what [server] adds, pinned as the rest
