"""The registered pyfunc model: loads in a fresh process, and `mlflow models serve` answers both request shapes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from needle.serve.pyfunc import EXAMPLE_TOOLS

OPENAI_TOOLS = [{"type": "function", "function": EXAMPLE_TOOLS[0]}]


@pytest.fixture(scope="module")
def champion(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A SQLite MLflow store with the tiny model logged as pyfunc and registered as needle@champion."""
    from mlflow.tracking import MlflowClient

    from needle.serve.pyfunc import log_pyfunc_to_run

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("serve", artifact_location=(root / "artifacts").as_uri())
    run = client.create_run(exp)
    log_pyfunc_to_run(client, run.info.run_id, tiny_model_dir)
    client.set_terminated(run.info.run_id)
    client.create_registered_model("needle")
    # As needle.registry.register_version does: the version's source is <run artifacts>/model.
    mv = client.create_model_version("needle", f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    client.set_registered_model_alias("needle", "champion", mv.version)
    # The venv's bin first: `mlflow models serve` runs `uvicorn` from PATH.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": uri, "NEEDLE_CACHE_DIR": str(root / "cache")}
    return {"uri": uri, "root": str(root), "env": env}  # type: ignore[dict-item]


def test_champion_loads_and_predicts_in_a_fresh_process(champion: dict) -> None:
    script = (
        "import json, pandas as pd, mlflow.pyfunc\n"
        "m = mlflow.pyfunc.load_model('models:/needle@champion')\n"
        f"tools = {json.dumps(json.dumps(EXAMPLE_TOOLS))}\n"
        "df = pd.DataFrame({'query': ['Text Bob hi', 'x'], 'tools': [tools, '{broken']})\n"
        "out = m.predict(df)\n"
        "print(json.dumps(out.where(out.notna(), None).to_dict(orient='records')))\n"
        "import os, pathlib\n"
        "from needle.registry import resolve_model_dir\n"
        "from needle.model.io import load_model\n"
        "print(load_model(resolve_model_dir('models:/needle@champion')).model_cfg.preset)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=champion["env"], capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    rows = json.loads(lines[-2])
    assert rows[0]["error"] is None
    calls = json.loads(rows[0]["calls"])  # constrained: a list of calls to the offered tool
    assert isinstance(calls, list) and all(c["name"] == "send_message" for c in calls)
    assert rows[1]["calls"] is None and "tools is not valid JSON" in rows[1]["error"]
    assert lines[-1] == "tiny"  # the registered version is also a plain needle model directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes | dict) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_mlflow_models_serve_answers_both_shapes_and_survives_bad_requests(champion: dict) -> None:
    port = _free_port()
    cmd = [str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m", "models:/needle@champion",
           "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    log = open(Path(champion["root"]) / "serve.log", "w")
    server = subprocess.Popen(cmd, env=champion["env"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (Path(champion["root"]) / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not answer /ping in 180 s"
            time.sleep(1)
        records = [{"query": "Text Bob that dinner is at 8", "tools": json.dumps(EXAMPLE_TOOLS)},
                   {"query": "Text Bob", "tools": '[{"name": "f", "parameters": {"type": "string"}}]'}]  # fmt: skip
        status, out = _post(f"{base}/invocations", {"dataframe_records": records})
        assert status == 200, out
        first, second = out["predictions"]  # type: ignore[index]
        assert first["error"] is None and isinstance(json.loads(first["calls"]), list)
        assert second["calls"] is None and "parameters" in second["error"]

        chat = {"messages": [{"role": "user", "content": "Text Bob that dinner is at 8"}], "tools": OPENAI_TOOLS}
        status, out = _post(f"{base}/invocations", chat)
        assert status == 200, out
        assert out["object"] == "chat.completion"  # type: ignore[index]
        choice = out["choices"][0]  # type: ignore[index]
        for call in choice["message"].get("tool_calls") or []:
            assert call["type"] == "function" and call["function"]["name"] == "send_message"
            json.loads(call["function"]["arguments"])
        assert choice["finish_reason"] in ("tool_calls", "stop")

        # A chat body that passes the signature but cannot be served: an OpenAI error object.
        status, out = _post(f"{base}/invocations", {"messages": [{"role": "system", "content": "x"}]})
        assert status == 200 and out["error"]["message"] == "messages has no user turn"  # type: ignore[index]
        # Bodies MLflow itself refuses (not JSON, messages not a list): 400, and the server lives on.
        status, _ = _post(f"{base}/invocations", b"{not json")
        assert status == 400
        status, _ = _post(f"{base}/invocations", {"messages": "hi", "tools": OPENAI_TOOLS})
        assert status == 400
        with urllib.request.urlopen(f"{base}/ping", timeout=5) as resp:
            assert resp.status == 200  # still serving
    finally:
        _stop_group(server)
        log.close()


def _stop_group(proc: subprocess.Popen) -> None:
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
