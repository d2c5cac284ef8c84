"""Request shapes the served model answers, and its answers.

**Table** (``mlflow.pyfunc`` ``predict(DataFrame)``; over HTTP ``{"dataframe_records": [...]}``
or ``{"dataframe_split": ...}``): columns ``query`` (str) and ``tools`` (the tool list as a JSON
string, or the list itself); one output row per input row with ``calls`` (the call list as a
JSON string, ``"[]"`` for none; null on error) and ``error`` (null, or why the row could not
be served). Over HTTP the answer is ``{"predictions": [{"calls": …, "error": …}, …]}``.

**OpenAI chat** (a body with ``messages``, which MLflow's scoring server passes through
unwrapped): ``messages`` with the user turn (the last ``user`` message is the query) and
``tools`` in the OpenAI function format (``[{"type": "function", "function": {"name",
"description", "parameters"}}]``); the answer is a ``chat.completion`` object whose message
holds ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments": JSON
string}}]``, ``finish_reason`` ``"tool_calls"``) or, with no call, ``content`` ``""`` and
``finish_reason`` ``"stop"``. ``tool_choice`` ``"none"`` offers no tool, a named function only
that one (``"required"`` is taken as ``"auto"``: the grammar allows the empty list). A request that cannot be served answers an ``error`` object
(``{"error": {"message", "type": "invalid_request_error"}}``) instead of failing the server.

``params`` (``{"params": {"constrained": false}}`` over HTTP, or a chat body's own
``"constrained"`` key) turns the grammar off; it is on by default.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from needle.data.render import compact_json

CHAT_KEY = "messages"


def _tools_of(value: Any) -> Any:
    """A tool list from a JSON string or a list; OpenAI ``{"type": "function", "function": …}`` unwrapped."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tools is not valid JSON: {exc.msg} at char {exc.pos}") from None
    if hasattr(value, "tolist"):  # a numpy array from a DataFrame cell
        value = value.tolist()
    if isinstance(value, dict) and "tools" in value:
        value = value["tools"]
    if not isinstance(value, list):
        raise ValueError(f"tools must be a JSON list of tools, got {type(value).__name__}")
    out = []
    for tool in value:
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
            tool = tool["function"]
        if isinstance(tool, dict):
            tool = {k: v for k, v in tool.items() if k != "strict"}
        out.append(tool)
    return out


def _flag(value: Any, default: bool = True) -> bool:
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "off")
    return bool(value)


def is_chat(model_input: Any) -> bool:
    """True for an OpenAI-style chat body (a mapping with ``messages``), as a dict or one-row table."""
    if isinstance(model_input, dict):
        return CHAT_KEY in model_input
    columns = getattr(model_input, "columns", None)
    return columns is not None and CHAT_KEY in columns


def answer(predictor: Any, model_input: Any, params: dict[str, Any], model_name: str = "needle") -> Any:
    """The model's answer to ``model_input`` (module doc); never raises for a bad request."""
    constrained = _flag(params.get("constrained"))
    if is_chat(model_input):
        body = model_input if isinstance(model_input, dict) else model_input.iloc[0].to_dict()
        return chat_answer(predictor, body, constrained, model_name)
    return table_answer(predictor, model_input, constrained)


def _cell(row: Any, key: str) -> Any:
    value = row.get(key) if isinstance(row, dict) else None
    try:
        import pandas as pd

        if value is not None and not isinstance(value, (list, dict)) and pd.isna(value):
            return None
    except (TypeError, ValueError):
        pass
    return value


def table_answer(predictor: Any, model_input: Any, constrained: bool) -> Any:
    """One ``{"calls", "error"}`` row per input row, as a DataFrame."""
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        records = model_input.to_dict(orient="records")
    elif isinstance(model_input, dict):
        records = [model_input]
    elif isinstance(model_input, list):
        records = [r if isinstance(r, dict) else {} for r in model_input]
    else:
        records = []
    results: list[dict[str, Any]] = [{"calls": None, "error": None} for _ in records]
    requests, where = [], []
    for i, rec in enumerate(records):
        try:
            query = _cell(rec, "query")
            if query is None:
                raise ValueError("missing column 'query'")
            raw_tools = _cell(rec, "tools")
            if raw_tools is None:
                raise ValueError("missing column 'tools'")
            requests.append((query, _tools_of(raw_tools)))
            where.append(i)
        except ValueError as exc:
            results[i]["error"] = str(exc)
    for i, pred in zip(where, _predict(predictor, requests, constrained)):
        if isinstance(pred, dict):
            results[i]["error"] = pred["error"]
        else:
            results[i]["calls"] = compact_json(pred)
    return pd.DataFrame(results, columns=["calls", "error"], dtype=object)  # None stays None (null), not NaN


def _predict(predictor: Any, requests: list[tuple[Any, Any]], constrained: bool) -> list[Any]:
    if not requests:
        return []
    try:
        return predictor.predict(requests, constrained=constrained)
    except Exception as exc:  # noqa: BLE001  # a serving process must answer, not die
        return [{"error": f"internal error: {type(exc).__name__}: {exc}", "raw": ""}] * len(requests)


def chat_error(message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (``invalid_request_error``)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def _user_query(messages: Any) -> str:
    if hasattr(messages, "tolist"):
        messages = messages.tolist()
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise ValueError("messages has no user turn")
    content = users[-1].get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("the user turn has no text content")
    return content


def _chosen(tools: list[Any], choice: Any) -> list[Any]:
    """The tools ``tool_choice`` leaves: all (``auto``, ``required``, absent), none, or the named one."""
    if choice is None or choice in ("auto", "required"):
        return tools
    if choice == "none":
        return []
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                         "\"function\": {\"name\": ...}}")
    named = [t for t in tools if isinstance(t, dict) and t.get("name") == name]
    if not named:
        raise ValueError(f"tool_choice names {name!r}, which is not among the offered tools")
    return named


def chat_answer(predictor: Any, body: dict[str, Any], constrained: bool, model_name: str) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` with ``tool_calls`` for one chat body (or an error object)."""
    try:
        query = _user_query(body.get(CHAT_KEY))
        tools = _tools_of(body.get("tools") if body.get("tools") is not None else [])
        tools = _chosen(tools, body.get("tool_choice"))
        constrained = _flag(body.get("constrained"), constrained)
    except ValueError as exc:
        return chat_error(str(exc))
    pred = _predict(predictor, [(query, tools)], constrained)[0]
    if isinstance(pred, dict):
        return chat_error(pred["error"])
    calls = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c["name"], "arguments": compact_json(c["arguments"])}}
        for c in pred
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else "", "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model") or model_name),
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "tool_calls" if calls else "stop"}],  # fmt: skip
    }
