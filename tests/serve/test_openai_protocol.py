"""The OpenAI route as real clients read it (issue 31, item 5): against `needle serve` of a tiny
model, the `openai` client and a raw-HTTP client (urllib) read `usage` and `finish_reason` from
every reply, streamed or not (streamed: the last choice chunk has the finish_reason, and with
stream_options.include_usage a last chunk the usage); a reply cut by its budget is a 200 with
`finish_reason: "length"`; sampling fields are honoured or refused by name; tool schemas in the
dialects clients send are served. MLflow's /invocations honours the same fields."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from needle.serve.pyfunc import EXAMPLE_TOOLS
from serve_helpers import free_port, post, post_events, reassemble, stop_group, wait_for_ping
from test_dialects import AREA, PING

TOOLS = [{"type": "function", "function": EXAMPLE_TOOLS[0]}]
MESSAGES = [{"role": "user", "content": "Text Bob that dinner is at 8"}]
# What each reply is asked for, and the finish reasons it may end with (a random model's words run
# to their budget; its calls end with the list or are cut).
CASES = {
    "calls": ({"tool_choice": "required"}, ("tool_calls", "length")),
    "words": ({"tool_choice": "none"}, ("stop", "length")),
    "calls cut by max_tokens": ({"tool_choice": "required", "max_tokens": 2}, ("length",)),
    "words cut by max_completion_tokens": ({"tool_choice": "none", "max_completion_tokens": 3}, ("length",)),
    "calls, greedy sampling fields": ({"temperature": 0.001, "top_p": 0.9, "seed": 3, "n": 1}, ("tool_calls", "length",
                                                                                                  "stop")),
}  # fmt: skip
BUDGETS = {"calls cut by max_tokens": 2, "words cut by max_completion_tokens": 3}


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`needle serve` of the tiny model directory on a free port: its base URL."""
    root = tmp_path_factory.mktemp("protocol")
    port, log_path = free_port(), root / "serve.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "needle.cli", "serve", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_ping(server, url, log_path)
        yield url
    finally:
        stop_group(server)
        log.close()


def _check_usage(usage: dict, budget: int | None) -> None:
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if budget is not None:
        assert usage["completion_tokens"] == budget  # cut: the whole budget was decoded


def test_the_openai_client_reads_usage_and_finish_reason_streamed_or_not(base: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="not-checked", max_retries=0, timeout=120)
    for name, (extra, finishes) in CASES.items():
        reply = client.chat.completions.create(model="needle", messages=MESSAGES, tools=TOOLS, **extra)
        choice = reply.choices[0]
        assert choice.finish_reason in finishes, (name, choice)
        assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls), name
        _check_usage(reply.usage.model_dump(), BUDGETS.get(name))
        streamed = reassemble(client.chat.completions.create(model="needle", messages=MESSAGES, tools=TOOLS,
                                                              stream=True, stream_options={"include_usage": True},
                                                              **extra))  # fmt: skip
        assert streamed["finish_reason"] == choice.finish_reason and streamed["usage"] == reply.usage, name
        assert streamed["content"] == (choice.message.content or "")
        plain = reassemble(client.chat.completions.create(model="needle", messages=MESSAGES, tools=TOOLS, stream=True,
                                                          **extra))  # fmt: skip
        assert plain["finish_reason"] == choice.finish_reason and plain["usage"] is None  # as OpenAI: only when asked
    # Fields greedy decoding cannot honour: a 400 naming the field, which the client raises.
    for field, value in (("n", 2), ("temperature", 0.7), ("max_tokens", 0), ("max_completion_tokens", -1),
                         ("presence_penalty", 1.0), ("stop", ["a", "b", "c", "d", "e"])):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="needle", messages=MESSAGES, tools=TOOLS, **{field: value})
        assert err.value.param == field, (field, err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="needle", messages=MESSAGES, tools=TOOLS, stream=True,
                                       stream_options={"include_usage": "yes"})  # fmt: skip
    assert err.value.param == "stream_options"
    # Tool schemas in a benchmark's dialect ("dict", "float", "tuple", "any", no type) are served.
    reply = client.chat.completions.create(model="needle", messages=[{"role": "user", "content": "ping example.org"}],
                                           tools=[{"type": "function", "function": t} for t in (AREA, PING)])
    assert reply.choices[0].finish_reason in ("tool_calls", "stop", "length") and reply.usage.total_tokens > 0


def test_a_raw_http_client_reads_usage_and_finish_reason_streamed_or_not(base: str) -> None:
    for name, (extra, finishes) in CASES.items():
        body = {"model": "needle", "messages": MESSAGES, "tools": TOOLS, **extra}
        status, reply = post(f"{base}/v1/chat/completions", body)
        assert status == 200, (name, reply)
        finish = reply["choices"][0]["finish_reason"]  # type: ignore[index]
        assert finish in finishes, (name, reply)
        _check_usage(reply["usage"], BUDGETS.get(name))  # type: ignore[index]
        status, events = post_events(f"{base}/v1/chat/completions",
                                     {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200
        *choice_chunks, last = events
        assert last["choices"] == [] and last["usage"] == reply["usage"], name  # type: ignore[index]
        assert [c["choices"][0]["finish_reason"] for c in choice_chunks][-1] == finish
        assert all(c["usage"] is None for c in choice_chunks)
        # The same body through MLflow's /invocations: the fields reach the model there too.
        status, via_mlflow = post(f"{base}/invocations", body)
        assert status == 200, (name, via_mlflow)
        assert via_mlflow["choices"][0]["finish_reason"] == finish, (name, via_mlflow)  # type: ignore[index]
        assert via_mlflow["usage"] == reply["usage"], name  # type: ignore[index]
    status, refused = post(f"{base}/invocations", {"messages": MESSAGES, "tools": TOOLS, "temperature": 1.0})
    assert status == 200 and refused["error"]["param"] == "temperature"  # type: ignore[index]  # /invocations: 200
    status, refused = post(f"{base}/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "n": 3})
    assert status == 400 and refused["error"]["param"] == "n"  # type: ignore[index]
