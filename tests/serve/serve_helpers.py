"""Helpers of the serving tests that start a real server: a free port, a JSON POST (plain or
server-sent events), waiting for ``/ping``, stopping the server's process group, reassembling an
OpenAI stream."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: bytes | dict) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def post_events(url: str, body: dict) -> tuple[int, list]:
    """POST ``body`` and read a ``text/event-stream`` answer: the JSON of each ``data:`` event
    before ``data: [DONE]`` (which must end it)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers.get_content_type() == "text/event-stream"
        data = [line[len(b"data: "):].decode() for line in resp.read().splitlines() if line.startswith(b"data: ")]
        status = resp.status
    assert data[-1] == "[DONE]", data[-3:]
    return status, [json.loads(d) for d in data[:-1]]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (mlflow + uvicorn), SIGKILL it if it lingers."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


def wait_for_ping(server: subprocess.Popen, base: str, log: Path, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(f"{base}/ping", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        assert server.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"server did not answer /ping in {limit_s:.0f} s"
        time.sleep(1)


def reassemble(stream) -> dict:
    """Content, (name, arguments) per call, call ids, finish_reason and usage (of the choiceless last
    chunk, with ``stream_options={"include_usage": True}``; else None) of a chat.completion.chunk stream."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
        finish = chunk.choices[0].finish_reason or finish
    ordered = [calls[i] for i in sorted(calls)]
    return {"content": content, "calls": [(c["name"], c["arguments"]) for c in ordered],
            "ids": [c["id"] for c in ordered], "finish_reason": finish, "usage": usage}  # fmt: skip
