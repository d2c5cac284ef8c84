"""A watchdog that stops the embedded run's temporary Prefect server when its owner dies.

Prefect's ephemeral API (an embedded `needle finetune`) is a uvicorn child process that the
owner stops at exit; after a `kill -9` of the owner nobody does, and it keeps listening.
``watch_ephemeral_server()`` starts this module as a small detached process that polls the
owner once a second, remembers the owner's Prefect server children, and terminates them once
the owner is gone; then it exits. It is started only when no PREFECT_API_URL is configured.

    python -m needle_flows.reaper <owner-pid> <owner-create-time>   # what watch_ephemeral_server runs
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

SERVER_MARK = "prefect.server.api.server:create_app"
_started: Optional[subprocess.Popen[bytes]] = None


def watch_ephemeral_server() -> Optional[subprocess.Popen[bytes]]:
    """Start the watchdog for this process once, if Prefect runs on its ephemeral API."""
    global _started
    from prefect.settings import get_current_settings

    if _started is not None or get_current_settings().api.url:
        return None
    import psutil

    me = psutil.Process()
    _started = subprocess.Popen(
        [sys.executable, "-m", "needle_flows.reaper", str(me.pid), f"{me.create_time():.2f}"],
        start_new_session=True,  # a kill of the owner's process group leaves the watchdog to clean up
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    return _started


def owner_alive(pid: int, created: float) -> bool:
    """Whether the process ``pid`` that started at ``created`` still runs (a reused pid is not it)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - created) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def server_children(pid: int) -> list[object]:
    """The owner's child processes that are Prefect API servers."""
    import psutil

    found = []
    try:
        children = psutil.Process(pid).children(recursive=False)
    except psutil.Error:
        return []
    for child in children:
        try:
            if any(SERVER_MARK in part for part in child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def watch(pid: int, created: float, poll_s: float = 1.0) -> int:
    """Poll the owner; when it is gone, stop the servers it had started. Returns how many."""
    import psutil

    servers: dict[int, object] = {}
    while owner_alive(pid, created):
        for child in server_children(pid):
            servers[child.pid] = child  # type: ignore[attr-defined]
        time.sleep(poll_s)
    alive = [p for p in servers.values() if p.is_running()]  # type: ignore[attr-defined]
    for proc in alive:
        proc.terminate()  # type: ignore[attr-defined]
    _, still = psutil.wait_procs(alive, timeout=5)  # type: ignore[arg-type]
    for proc in still:
        proc.kill()
    return len(alive)


if __name__ == "__main__":
    sys.exit(0 if watch(int(sys.argv[1]), float(sys.argv[2])) >= 0 else 1)
