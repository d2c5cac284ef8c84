"""The agent's loop against `needle serve`, with the real `openai` client: a model trained on the
sample's conversations calls a tool, the client runs it as a local Python function and sends the
result, and the model answers in words, within 3 round trips; the same with ``stream=True``. A bad
conversation in between is a 400 with OpenAI's error object and the loop goes on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from needle.data.sample_tools import NEW_TOOLS
from serve_helpers import free_port, reassemble, stop_group, wait_for_ping

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {t.name: t for t in NEW_TOOLS}
OFFER = [{"type": "function", "function": TOOLS[name].schema()} for name in ("get_tip", "set_fan")]
MAX_TRIPS = 3

pytestmark = pytest.mark.slow


def get_tip(amount: float, percent: int) -> dict[str, float]:
    """The client's own implementation of the offered tool."""
    return {"tip": round(amount * percent / 100, 2)}


def set_fan(room: str, speed: int) -> dict[str, int]:
    return {"speed": speed}


LOCAL = {"get_tip": get_tip, "set_fan": set_fan}


@pytest.fixture(scope="module")
def conversation_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained from scratch on the bundled sample's 600 conversations (`needle train`,
    300 steps: under a minute on 2 cores)."""
    root = tmp_path_factory.mktemp("agent")
    lines = (ROOT / "data" / "sample" / "new.jsonl").read_text().splitlines()
    conversations = [line for line in lines if "messages" in json.loads(line)]
    assert len(conversations) == 600
    (root / "rows.jsonl").write_text("\n".join(conversations) + "\n")
    cmd = [sys.executable, "-m", "needle.cli", "train", str(root / "rows.jsonl"), "--out", str(root / "run"),
           "--mode", "scratch", "--preset", "tiny", "--steps", "300", "--batch-size", "8"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run" / "model"


def _ask(client: Any, messages: list[dict[str, Any]], stream: bool) -> tuple[str | None, list[dict[str, Any]], str]:
    """One round trip: the reply's content, its calls as assistant-message dicts, its finish_reason."""
    reply = client.chat.completions.create(model="needle", messages=messages, tools=OFFER, stream=stream)
    if stream:
        parts = reassemble(reply)
        calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                 for i, (n, a) in zip(parts["ids"], parts["calls"])]  # fmt: skip
        return parts["content"] or None, calls, parts["finish_reason"]
    choice = reply.choices[0]
    calls = [c.model_dump(include={"id", "type", "function"}) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def run_agent(client: Any, query: str, stream: bool) -> list[tuple[str | None, list[dict[str, Any]], str]]:
    """The client's loop: ask; while the model calls, run each call locally and send its result."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": query}]
    trips = []
    for _ in range(MAX_TRIPS):
        content, calls, finish = _ask(client, messages, stream)
        trips.append((content, calls, finish))
        if not calls:
            break
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in calls:
            result = LOCAL[call["function"]["name"]](**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    return trips


def test_agent_loop_with_the_openai_client(conversation_model: Path, tmp_path: Path) -> None:
    import openai

    port = free_port()
    log_path = tmp_path / "needle-serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "needle.cli", "serve", str(conversation_model),
                                   "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_for_ping(server, f"http://127.0.0.1:{port}", log_path)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-checked", max_retries=0,
                                   timeout=120)  # fmt: skip
            for query in ("Calculate a 15 percent tip for a bill of 80", "What is a 20 percent tip on 45.50?"):
                trips = run_agent(client, query, stream=False)
                content, calls, finish = trips[0]
                assert calls and finish == "tool_calls", trips  # the model acts first
                assert calls[0]["function"]["name"] == "get_tip", trips
                content, calls, finish = trips[-1]
                assert not calls and content and finish in ("stop", "length"), trips  # then answers in words
                made = [json.dumps(c["function"]) for _, cs, _ in trips for c in cs]
                assert len(made) == len(set(made)), trips  # never the same call again
                streamed = run_agent(client, query, stream=True)  # greedy: the same loop, chunk by chunk
                assert [(c, [x["function"] for x in cs], f) for c, cs, f in streamed] == \
                       [(c, [x["function"] for x in cs], f) for c, cs, f in trips]  # fmt: skip

                # A result for a call nobody made: OpenAI's error object, 400; the server goes on.
                bad = [{"role": "user", "content": query}, {"role": "tool", "tool_call_id": "nope", "content": "{}"}]
                with pytest.raises(openai.BadRequestError) as err:
                    client.chat.completions.create(model="needle", messages=bad, tools=OFFER)
                assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error"
            assert server.poll() is None
        finally:
            stop_group(server)
