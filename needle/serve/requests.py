"""Request shapes the served model answers, and its answers.

**Table** (``mlflow.pyfunc`` ``predict(DataFrame)``; over HTTP ``{"dataframe_records": [...]}``
or ``{"dataframe_split": ...}``): columns ``query`` (str) or ``messages`` (a conversation so far
in the OpenAI chat layout, a list; null in a query row), and ``tools`` (the tool list as a JSON
string, or the list itself). One output row per input row with ``calls`` (the call list as a
JSON string, ``"[]"`` for none; null on error), ``content`` (a conversation row's answer in
words, else null) and ``error`` (null, or why the row could not be served). A query row answers
a call list (``[]`` when no tool fits); a conversation row calls or answers in text, as its
optional ``tool_choice`` column says (the chat shape's values; null is ``auto``). Over HTTP
the answer is ``{"predictions": [{"calls": …, "content": …, "error": …}, …]}``. (MLflow hands a
chat body to the model as a one-row table with ``messages``: a one-row table is read as the
table shape only when it has a ``query`` column, null for a conversation row.)

**OpenAI chat** (a body with ``messages``, which MLflow's scoring server passes through
unwrapped): the whole conversation so far (system, user, assistant turns with ``tool_calls``,
``tool`` results; validated as a data row's, needle/serve/prompt.py) and ``tools`` in the OpenAI
function format (``[{"type": "function", "function": {"name", "description", "parameters"}}]``);
the prompt is the conversation rendered as training renders it. The answer is a
``chat.completion`` whose message holds ``tool_calls`` (``[{"id", "type": "function", "function":
{"name", "arguments": JSON string}}]``, ``finish_reason`` ``"tool_calls"``) or the text
``content`` (``finish_reason`` ``"stop"``, ``"length"`` when the token budget ran out; a turn
the budget cut before it could be read, such as a half-written call, is its raw text with
``"length"``, not an error), and ``usage`` (``prompt_tokens`` as the model saw them,
``completion_tokens`` decoded, the end marker included, and ``total_tokens``).
``tool_choice``: ``auto`` (default) lets the grammar write calls or text, ``required`` calls
only (at least one), a named function calls to that tool only, ``none`` text only; the prompt
lists every offered tool in each case. A request that cannot be served answers an ``error``
object (``{"error": {"message", "type": "invalid_request_error"}}``) instead of failing the
server.

The chat body's sampling fields, as greedy decoding (needle/eval/decode.py) can honour them:
``max_tokens``/``max_completion_tokens`` (an integer >= 1; both given: the smaller) is the
answer's budget, capped by what the prompt leaves of the context (default: the server's, 96);
``stop`` (a string or up to 4) cuts a text answer before the first one (``finish_reason``
``"stop"``); ``temperature`` 0 or absent (at most ``GREEDY_TEMPERATURE``, 0.01, is read as 0:
harnesses send 0.001 for "greedy"); ``top_p`` in (0, 1] and any integer ``seed`` change nothing
in a greedy reply, so they are accepted; ``n`` 1, penalties 0 and ``logprobs`` false likewise.
Anything else is refused with a 400 that names the field (``param``). The tools' schemas may be
in the dialects clients send (needle/serve/dialects.py).

``params`` (``{"params": {"constrained": false}}`` over HTTP, or a chat body's own
``"constrained"`` key) turns the grammar off (``tool_choice`` is then not enforced); it is on by
default.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from needle.data.render import compact_json
from needle.serve.prompt import Answer, Request

CHAT_KEY = "messages"
# The OpenAI fields a chat body may carry (module doc); the pyfunc signature declares them, so that
# MLflow's /invocations passes them through.
PROTOCOL_KEYS = ("max_tokens", "max_completion_tokens", "n", "stop", "temperature", "top_p", "seed",
                 "presence_penalty", "frequency_penalty", "logprobs")  # fmt: skip
GREEDY_TEMPERATURE = 0.01
MAX_STOP = 4


class ParamError(ValueError):
    """A chat body's field that this server cannot honour; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
    """True for an OpenAI-style chat body (a mapping with ``messages``), as a dict or as the one-row
    table MLflow makes of it (no ``query`` column: a table of conversations has one; module doc)."""
    if isinstance(model_input, dict):
        return CHAT_KEY in model_input
    columns = getattr(model_input, "columns", None)
    return columns is not None and CHAT_KEY in columns and "query" not in columns and len(model_input) == 1


def answer(predictor: Any, model_input: Any, params: dict[str, Any], model_name: str = "needle") -> Any:
    """The model's answer to ``model_input`` (module doc); never raises for a bad request."""
    constrained = _flag(params.get("constrained"))
    if is_chat(model_input):
        body = model_input if isinstance(model_input, dict) else model_input.iloc[0].to_dict()
        return chat_answer(predictor, body, constrained, model_name)
    return table_answer(predictor, model_input, constrained)


def _cell(row: Any, key: str) -> Any:
    value = row.get(key) if isinstance(row, dict) else None
    if hasattr(value, "tolist"):  # a numpy array from a DataFrame cell
        value = value.tolist()
    try:
        import pandas as pd

        if value is not None and not isinstance(value, (list, dict)) and pd.isna(value):
            return None
    except (TypeError, ValueError):
        pass
    return value


def _table_request(rec: Any) -> Request:
    raw_tools = _cell(rec, "tools")
    if raw_tools is None:
        raise ValueError("missing column 'tools'")
    messages, query = _cell(rec, CHAT_KEY), _cell(rec, "query")
    if messages is not None:
        if query is not None:
            raise ValueError("a row has either 'query' or 'messages', not both")
        tools = _tools_of(raw_tools)
        mode, only = _choice(_cell(rec, "tool_choice"), tools)  # a table row may carry its own tool_choice
        return Request(messages=messages, tools=tools, mode=mode, only=only)
    if query is None:
        raise ValueError("missing column 'query'")
    return Request(query=query, tools=_tools_of(raw_tools))


def table_answer(predictor: Any, model_input: Any, constrained: bool) -> Any:
    """One ``{"calls", "content", "error"}`` row per input row, as a DataFrame."""
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        records = model_input.to_dict(orient="records")
    elif isinstance(model_input, dict):
        records = [model_input]
    elif isinstance(model_input, list):
        records = [r if isinstance(r, dict) else {} for r in model_input]
    else:
        records = []
    results: list[dict[str, Any]] = [{"calls": None, "content": None, "error": None} for _ in records]
    requests, where = [], []
    for i, rec in enumerate(records):
        try:
            requests.append(_table_request(rec))
            where.append(i)
        except ValueError as exc:
            results[i]["error"] = str(exc)
    for i, pred in zip(where, _predict(predictor, requests, constrained)):
        if isinstance(pred, dict) and "error" in pred:
            results[i]["error"] = pred["error"]
        elif isinstance(pred, dict):
            results[i]["calls"], results[i]["content"] = "[]", pred["content"]
        else:
            results[i]["calls"] = compact_json(pred)
    # dtype object: None stays None (null), not NaN
    return pd.DataFrame(results, columns=["calls", "content", "error"], dtype=object)


def _predict(predictor: Any, requests: list[Request], constrained: bool) -> list[Any]:
    return [a.prediction for a in _answers(predictor, requests, constrained)]


def _answers(predictor: Any, requests: list[Request], constrained: bool, on_token: Any = None) -> list[Answer]:
    if not requests:
        return []
    try:
        if on_token is not None:  # a streamed chat request: one request, its tokens as they are decoded
            return predictor.predict_detailed(requests, constrained=constrained, on_token=lambda _, t: on_token(t))
        return predictor.predict_detailed(requests, constrained=constrained)
    except Exception as exc:  # noqa: BLE001  # a serving process must answer, not die
        fault = {"error": f"internal error: {type(exc).__name__}: {exc}", "raw": "", "internal": True}
        return [Answer(fault)] * len(requests)


def chat_error(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object: ``invalid_request_error`` (the request's fault, HTTP 400) or
    ``server_error`` (the server's, 500)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _choice(choice: Any, tools: list[Any]) -> tuple[str, str | None]:
    """``(mode, only)`` of ``tool_choice`` (module doc)."""
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        if choice == "required" and not tools:
            raise ValueError("tool_choice is 'required' but no tools are offered")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                         "\"function\": {\"name\": ...}}")
    if not any(isinstance(t, dict) and t.get("name") == name for t in tools):
        raise ValueError(f"tool_choice names {name!r}, which is not among the offered tools")
    return "required", name


def _number(body: Any, key: str, integer: bool = False) -> float | int | None:
    """``body[key]`` as a number (an integer with ``integer``), None when absent; ParamError if neither."""
    value = _cell(body, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (integer and isinstance(value, float) and not value.is_integer()):  # fmt: skip
        raise ParamError(f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    return int(value) if integer else value


def _budget(body: Any) -> int | None:
    """The answer's token budget the body asks for (the smaller of the two fields), or None."""
    given = []
    for key in ("max_completion_tokens", "max_tokens"):
        value = _number(body, key, integer=True)
        if value is not None and value < 1:
            raise ParamError(f"{key} must be at least 1, got {value}", key)
        if value is not None:
            given.append(int(value))
    return min(given) if given else None


def stop_strings(body: Any) -> tuple[str, ...]:
    value = _cell(body, "stop")
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ParamError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise ParamError(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _check_greedy(body: Any) -> None:
    """ParamError naming the first sampling field that greedy decoding cannot honour (module doc)."""
    n = _number(body, "n", integer=True)
    if n is not None and n < 1:
        raise ParamError(f"n must be at least 1, got {n}", "n")
    if n is not None and n > 1:
        raise ParamError(f"n={n} is not supported: decoding is greedy, so a request has one answer (send n=1 or "
                         "leave it out)", "n")  # fmt: skip
    temperature = _number(body, "temperature")
    if temperature is not None and not 0 <= temperature <= GREEDY_TEMPERATURE:
        raise ParamError(f"temperature={temperature:g} is not supported: this server decodes greedily (send 0, at "
                         f"most {GREEDY_TEMPERATURE:g}, or leave it out)", "temperature")  # fmt: skip
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise ParamError(f"top_p must be in (0, 1], got {top_p:g}", "top_p")
    _number(body, "seed", integer=True)  # any integer: a greedy reply is the same under every seed
    for key in ("presence_penalty", "frequency_penalty"):
        value = _number(body, key)
        if value:
            raise ParamError(f"{key}={value:g} is not supported: decoding is greedy, without penalties (send 0 or "
                             "leave it out)", key)  # fmt: skip
    if _cell(body, "logprobs") not in (None, False):
        raise ParamError("logprobs is not supported: replies carry no log-probabilities", "logprobs")


def chat_request(body: dict[str, Any]) -> Request:
    """The predictor's request for a chat body; ValueError (ParamError for a field) saying what is wrong."""
    messages = _cell(body, CHAT_KEY)  # _cell: a numpy array as a list, a NaN (MLflow's empty cell) as None
    if not isinstance(messages, list) or not messages:
        raise ParamError("messages must be a non-empty list", CHAT_KEY)
    _check_greedy(body)
    tools = _tools_of(_cell(body, "tools") if _cell(body, "tools") is not None else [])
    mode, only = _choice(_cell(body, "tool_choice"), tools)
    return Request(messages=messages, tools=tools, mode=mode, only=only, max_tokens=_budget(body),
                   stop=stop_strings(body))


def usage(answer: Answer) -> dict[str, int]:
    """OpenAI's ``usage`` object of an answer."""
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens}  # fmt: skip


def chat_answer(predictor: Any, body: dict[str, Any], constrained: bool, model_name: str,
                on_token: Any = None) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` (tool calls or text) for one chat body, or an error object;
    ``on_token(id)`` hears each token as it is decoded (``stream: true``, needle/serve/stream.py)."""
    try:
        request = chat_request(body)
        constrained = _flag(body.get("constrained"), constrained)
    except ValueError as exc:
        return chat_error(str(exc), getattr(exc, "param", None))
    done = _answers(predictor, [request], constrained, on_token)[0]
    pred = done.prediction
    if isinstance(pred, dict) and "error" in pred and not done.cut:
        return chat_error(pred["error"], kind="server_error" if pred.get("internal") else "invalid_request_error")
    message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
    if isinstance(pred, dict) and "error" in pred:  # the budget ran out before the turn could be read
        message["content"], finish = pred["raw"], "length"
    elif isinstance(pred, dict):
        message["content"] = pred["content"]
        finish = "stop" if pred.get("finished", True) else "length"
    else:
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": compact_json(c["arguments"])}}
            for c in pred
        ]  # fmt: skip
        finish = "tool_calls" if pred else "stop"
        message["content"] = None if pred else ""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model") or model_name),
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": usage(done),
    }
