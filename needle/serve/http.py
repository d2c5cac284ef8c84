"""HTTP serving of a needle model: MLflow's scoring server plus the OpenAI chat route.

    needle serve models:/needle@champion --port 5123          # or a run's model, or a model dir
    curl -s 127.0.0.1:5123/v1/chat/completions -H 'Content-Type: application/json' \
         -d '{"model": "needle", "messages": [{"role": "user", "content": "Text Bob hi"}], "tools": [...]}'

    from openai import OpenAI
    OpenAI(base_url="http://127.0.0.1:5123/v1", api_key="unused").chat.completions.create(...)

The app is MLflow's own (``mlflow.pyfunc.scoring_server.init``), so ``/ping``, ``/health``,
``/version`` and ``/invocations`` answer exactly as under ``mlflow models serve``; two routes
are added, because OpenAI client libraries post to ``<base_url>/chat/completions`` and MLflow's
server has only ``/invocations``:

- ``POST /v1/chat/completions``: an OpenAI chat request (the whole conversation so far, earlier
  calls and ``tool`` results included; ``tools`` in the function format; ``tool_choice``
  ``auto``/``none``/``required``/a named function) answered with a ``chat.completion`` whose
  message holds ``tool_calls`` or text ``content``. Both go through the pyfunc model's own
  ``predict`` (``needle.serve.requests.chat_answer``; a streamed one calls that with the pyfunc's
  predictor and a hook for each decoded token, needle/serve/stream.py). A request that cannot be
  served (a bad conversation included) answers HTTP 400 with OpenAI's ``{"error": {...}}`` object (client
  libraries raise ``BadRequestError``); a fault of the server's own (the decoder raising) answers
  500 with ``"type": "server_error"``. Either way the server keeps serving.
- ``GET /v1/models``: the one model, so ``client.models.list()`` works.

Every reply carries OpenAI's ``usage`` and ``finish_reason`` (``stop``, ``tool_calls``, ``length``:
a reply cut by its budget is a 200); ``max_tokens``, ``stop`` and the sampling fields are honoured
or refused by name as needle/serve/requests.py says (``n > 1`` is a 400: decoding is greedy).
``stream: true`` answers OpenAI's server-sent event chunks of the same reply, sent as it is
decoded (the text token by token, each call once the list is complete), the usage in a last
chunk with ``stream_options: {"include_usage": true}`` (needle/serve/stream.py; a request refused
before decoding is still a 400 with the error object).
FastAPI is imported at module level because the route handlers' annotations name its types.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from needle.errors import UsageError
from needle.serve.pyfunc import save_pyfunc
from needle.serve.requests import ParamError, chat_error as _error
from needle.serve.stream import include_usage, live

CHAT_ROUTE = "/v1/chat/completions"
MODELS_ROUTE = "/v1/models"


def refusal(body: Any) -> dict[str, Any] | None:
    """OpenAI's error object for a chat body this server cannot take, or None."""
    if not isinstance(body, dict):
        return _error(f"the request body must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        return _error("'messages' is a required property", "messages")
    try:
        include_usage(body)
    except ParamError as exc:
        return _error(str(exc), exc.param)
    return None


def load_pyfunc(location: str, work_dir: str | Path) -> Any:
    """The pyfunc model at ``location``: a ``models:/``/``runs:/`` URI, an MLflow model dir, or an
    exported needle model dir (wrapped as a pyfunc model under ``work_dir`` first)."""
    import mlflow.pyfunc

    path = Path(location)
    if path.is_dir() and not (path / "MLmodel").is_file():
        if not (path / "config.json").is_file():
            raise UsageError(f"{location}: neither an MLflow model (no MLmodel) nor a needle model directory "
                             "(no config.json)")  # fmt: skip

        path = save_pyfunc(path, Path(work_dir) / "pyfunc")
        location = str(path)
    elif not path.exists() and ":/" not in location:
        raise UsageError(f"{location}: no such model directory or model URI (models:/needle@champion, runs:/ID/model)")
    return mlflow.pyfunc.load_model(location)


def build_app(model: Any) -> Any:
    """MLflow's scoring app for ``model`` (a loaded pyfunc of a needle model) with the OpenAI routes."""
    from mlflow.pyfunc import scoring_server

    app = scoring_server.init(model)
    caller = model.unwrap_python_model()
    name = str(getattr(caller, "name", None) or "needle")
    created = int(time.time())

    async def chat_completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return JSONResponse(_error(f"the request body is not JSON: {exc}"), status_code=400)
        refused = refusal(body)
        if refused is not None:
            return JSONResponse(refused, status_code=400)
        if body.get("stream"):  # sent while it is decoded (needle/serve/stream.py)
            answer, events = await live(caller.predictor, body, name)
            if events is not None:
                return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        else:
            # The pyfunc's own predict (the chat shape of needle.serve.requests); a thread, so that
            # concurrent requests meet in the predictor's batch.
            answer = await asyncio.to_thread(caller.predict, None, body, {})
        if "error" in answer:  # the server's own fault is a 500, the request's a 400
            return JSONResponse(answer, status_code=500 if answer["error"].get("type") == "server_error" else 400)
        return JSONResponse(answer)

    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list",
                             "data": [{"id": name, "object": "model", "created": created, "owned_by": "needle"}]})

    app.post(CHAT_ROUTE)(chat_completions)
    app.get(MODELS_ROUTE)(list_models)
    return app


def serve(location: str, host: str = "127.0.0.1", port: int = 5123) -> None:
    """Load the model at ``location`` and serve it until interrupted (one process, requests batched)."""
    import uvicorn

    with tempfile.TemporaryDirectory(prefix="needle-serve-") as work:
        app = build_app(load_pyfunc(location, work))
        print(f"serving {location} on http://{host}:{port} (OpenAI base_url http://{host}:{port}/v1, "
              f"MLflow /invocations)", flush=True)  # fmt: skip
        uvicorn.run(app, host=host, port=port, log_level="warning")
