"""The registered pyfunc model: loads in a fresh process; `mlflow models serve` answers both request shapes;
`needle serve` also answers the OpenAI client library."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from needle.serve.pyfunc import EXAMPLE_TOOLS
from serve_helpers import free_port, post, reassemble, stop_group, wait_for_ping

OPENAI_TOOLS = [{"type": "function", "function": EXAMPLE_TOOLS[0]}]


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


def test_mlflow_models_serve_answers_both_shapes_and_survives_bad_requests(champion: dict) -> None:
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m", "models:/needle@champion",
           "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    log = open(Path(champion["root"]) / "serve.log", "w")
    server = subprocess.Popen(cmd, env=champion["env"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_ping(server, base, Path(champion["root"]) / "serve.log")
        records = [{"query": "Text Bob that dinner is at 8", "tools": json.dumps(EXAMPLE_TOOLS)},
                   {"query": "Text Bob", "tools": '[{"name": "f", "parameters": {"type": "string"}}]'}]  # fmt: skip
        status, out = post(f"{base}/invocations", {"dataframe_records": records})
        assert status == 200, out
        first, second = out["predictions"]  # type: ignore[index]
        assert first["error"] is None and isinstance(json.loads(first["calls"]), list)
        assert second["calls"] is None and "parameters" in second["error"]

        chat = {"messages": [{"role": "user", "content": "Text Bob that dinner is at 8"}], "tools": OPENAI_TOOLS}
        status, out = post(f"{base}/invocations", chat)
        assert status == 200, out
        assert out["object"] == "chat.completion"  # type: ignore[index]
        choice = out["choices"][0]  # type: ignore[index]
        for call in choice["message"].get("tool_calls") or []:
            assert call["type"] == "function" and call["function"]["name"] == "send_message"
            json.loads(call["function"]["arguments"])
        # A random model answering in words runs to its budget ("length"); a call list ends it.
        if choice["message"].get("tool_calls"):
            assert choice["finish_reason"] == "tool_calls"
        else:
            assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"]

        # A conversation with a call and its result passes MLflow's signature, tool_choice included
        # ("none": an answer in words), as a chat body and as a table row beside a query row.
        turn = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "send_message",
                                                          "arguments": '{"contact": "Bob", "text": "hi"}'}}]}  # fmt: skip
        conversation = [*chat["messages"], turn, {"role": "tool", "tool_call_id": "c1", "content": "sent"}]
        status, out = post(f"{base}/invocations", {**chat, "messages": conversation, "tool_choice": "none"})
        assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length"), out  # type: ignore[index]
        assert "tool_calls" not in out["choices"][0]["message"] and out["choices"][0]["message"]["content"]  # type: ignore[index]
        rows = [{"query": None, "messages": conversation, "tools": json.dumps(EXAMPLE_TOOLS)},
                {"query": "Text Bob hi", "messages": None, "tools": json.dumps(EXAMPLE_TOOLS)}]  # fmt: skip
        status, out = post(f"{base}/invocations", {"dataframe_records": rows})
        assert status == 200, out
        for row in out["predictions"]:  # type: ignore[index]
            assert row["error"] is None and isinstance(json.loads(row["calls"]), list), row

        # A chat body that passes the signature but cannot be served: an OpenAI error object.
        status, out = post(f"{base}/invocations", {"messages": [{"role": "system", "content": "x"}]})
        assert status == 200 and "must end with a user message" in out["error"]["message"]  # type: ignore[index]
        # Bodies MLflow itself refuses (not JSON, messages not a list): 400, and the server lives on.
        status, _ = post(f"{base}/invocations", b"{not json")
        assert status == 400
        status, _ = post(f"{base}/invocations", {"messages": "hi", "tools": OPENAI_TOOLS})
        assert status == 400
        with urllib.request.urlopen(f"{base}/ping", timeout=5) as resp:
            assert resp.status == 200  # still serving
    finally:
        stop_group(server)
        log.close()


def test_openai_client_talks_to_needle_serve(champion: dict) -> None:
    """`needle serve`: the OpenAI client library's chat.completions.create works for a single turn,
    answers what /invocations answers, and bad requests raise BadRequestError without harming the server."""
    import jsonschema
    import openai

    port = free_port()
    log_path = Path(champion["root"]) / "needle-serve.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "needle.cli", "serve", "models:/needle@champion", "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(cmd, env=champion["env"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_ping(server, base, log_path)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="not-checked", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["needle"]

        messages = [{"role": "user", "content": "Text Bob that dinner is at 8"}]
        reply = client.chat.completions.create(model="needle", messages=messages, tools=OPENAI_TOOLS)
        assert reply.object == "chat.completion" and len(reply.choices) == 1
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason in (("tool_calls",) if calls else ("stop", "length"))
        choice_of_first = choice.finish_reason
        schema = EXAMPLE_TOOLS[0]["parameters"]
        for call in calls:  # constrained: only the offered tool, arguments valid under its schema
            assert call.type == "function" and call.function.name == "send_message"
            jsonschema.validate(json.loads(call.function.arguments), schema)
        # The same request through MLflow's /invocations gives the same calls (one predict behind both).
        status, via_mlflow = post(f"{base}/invocations", {"messages": messages, "tools": OPENAI_TOOLS})
        assert status == 200
        mlflow_calls = via_mlflow["choices"][0]["message"].get("tool_calls") or []  # type: ignore[index]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in mlflow_calls] == \
               [(c.function.name, c.function.arguments) for c in calls]  # fmt: skip

        none = client.chat.completions.create(model="needle", messages=messages, tools=OPENAI_TOOLS, tool_choice="none")
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")

        with pytest.raises(openai.BadRequestError, match="'nope', which is not among the offered tools"):
            client.chat.completions.create(model="needle", messages=messages, tools=OPENAI_TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "nope"}})
        with pytest.raises(openai.BadRequestError, match="must end with a user message"):
            client.chat.completions.create(model="needle", messages=[{"role": "system", "content": "x"}])
        # The whole conversation: the call the model made and its result are in the prompt; the
        # reply calls again or answers in words. A bad conversation is a 400; the next good one works.
        first = calls[0] if calls else None
        if first is None:
            first = client.chat.completions.create(model="needle", messages=messages, tools=OPENAI_TOOLS,
                                                   tool_choice="required").choices[0].message.tool_calls[0]
        turn = {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]}
        result = {"role": "tool", "tool_call_id": first.id, "content": "sent"}
        with pytest.raises(openai.BadRequestError, match="answers no earlier call"):
            client.chat.completions.create(model="needle", messages=[*messages, turn, {**result, "tool_call_id": "x"}],
                                           tools=OPENAI_TOOLS)  # fmt: skip
        after = client.chat.completions.create(model="needle", messages=[*messages, turn, result], tools=OPENAI_TOOLS)
        choice = after.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
        words = client.chat.completions.create(model="needle", messages=[*messages, turn, result], tools=OPENAI_TOOLS,
                                               tool_choice="none").choices[0]  # fmt: skip
        assert words.message.tool_calls is None and words.message.content and words.finish_reason in ("stop", "length")

        # stream=True: the client's streaming API reassembles the same replies (greedy decoding).
        streamed = reassemble(client.chat.completions.create(model="needle", messages=messages, tools=OPENAI_TOOLS,
                                                              stream=True))  # fmt: skip
        assert streamed["calls"] == [(c.function.name, c.function.arguments) for c in calls]
        assert streamed["finish_reason"] == choice_of_first and all(i.startswith("call_") for i in streamed["ids"])
        streamed = reassemble(client.chat.completions.create(model="needle", messages=[*messages, turn, result],
                                                              tools=OPENAI_TOOLS, tool_choice="none", stream=True))
        assert streamed["content"] == words.message.content and streamed["calls"] == []
        assert streamed["finish_reason"] == words.finish_reason
        with pytest.raises(openai.BadRequestError, match="answers no earlier call"):  # errors stay a 400
            client.chat.completions.create(model="needle", messages=[*messages, turn, {**result, "tool_call_id": "x"}],
                                           tools=OPENAI_TOOLS, stream=True)  # fmt: skip
        status, out = post(f"{base}/v1/chat/completions", b"{not json")
        assert status == 400 and "not JSON" in out["error"]["message"]  # type: ignore[index]

        # Still serving, MLflow's table shape included.
        records = [{"query": "Text Bob hi", "tools": json.dumps(EXAMPLE_TOOLS)}]
        status, out = post(f"{base}/invocations", {"dataframe_records": records})
        assert status == 200 and out["predictions"][0]["error"] is None  # type: ignore[index]
    finally:
        stop_group(server)
        log.close()


def test_serve_refuses_a_location_that_is_no_model(tmp_path: Path) -> None:
    from needle.errors import UsageError
    from needle.serve.http import load_pyfunc

    with pytest.raises(UsageError, match="no such model directory or model URI"):
        load_pyfunc(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(UsageError, match="neither an MLflow model"):
        load_pyfunc(str(tmp_path), tmp_path)


def test_serve_wraps_a_plain_needle_model_dir(tiny_model_dir: Path, tmp_path: Path) -> None:
    import pandas as pd

    from needle.serve.http import load_pyfunc

    model = load_pyfunc(str(tiny_model_dir), tmp_path)
    out = model.predict(pd.DataFrame({"query": ["Text Bob hi"], "tools": [json.dumps(EXAMPLE_TOOLS)]}))
    assert out["error"].tolist() == [None] and isinstance(json.loads(out["calls"][0]), list)
