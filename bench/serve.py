"""Serving speed: a needle model behind `needle serve`, measured with real HTTP clients.

    python -m bench.serve [--model DIR|URI] [--requests 30] [--eval-rows 100] [--out bench/results/serve.json]
    python -m bench.serve --libs      # llguidance vs xgrammar vs outlines-core, whichever are installed
    python -m bench.serve --prefix    # the prefix cache alone (bench/results/serve_prefix.json)

Saves the model as the pyfunc model the flow registers (needle/serve/pyfunc.py), serves it with
`needle serve` (MLflow's own scoring app, so ``/invocations`` is what `mlflow models serve`
answers, plus the OpenAI route) on a free 127.0.0.1 port, then measures for each request shape
(table on ``/invocations`` with urllib; chat on ``/v1/chat/completions`` with the OpenAI client
library): one client sending requests one after another (latency p50/p95, one query each), four
concurrent clients (requests/s; the server batches rows that arrive during a decode,
needle/serve/engine.py), each after an unmeasured warm-up that compiles the shapes; and
in-process constrained vs free decoding rows/s on held-out
rows of data/sample/new.jsonl (the second, warm pass of each). ``--model`` defaults to the newest
tuned model under .state/finetune (the main job's); without one it uses a random-init ``small``
model and says so in the JSON.

``prefix`` (needle/serve/prefix_cache.py): conversations of 1, 3 and 6 turns over one system turn
and the sample's 11 new tools, built from the sample's conversations. A client sends each turn in
order, resending the conversation so far; the last turn's latency is measured (p50/p95 over
``--conversations``), by the in-process ``Predictor`` the server runs, with the cache off and on.
The model is a random-init ``small`` shape with a 2,048-token context (the trained ``small``
model's 320 cannot hold 6 turns); a warm-up set of other conversations compiles the shapes first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from needle.config import EvalConfig, model_preset
from needle.data.load import read_rows
from needle.data.render import render_text
from needle.data.sample_tools import NEW_TOOLS
from needle.eval.constrain import call_list_schema
from needle.eval.evaluate import evaluate_model
from needle.model.io import load_model, save_model
from needle.model.lora import init_params
from needle.serve.engine import DEFAULT_PREFIX_CACHE_MB, Predictor
from needle.serve.prompt import Request
from needle.serve.pyfunc import local_model_dir, save_pyfunc
from needle.tokenizers.native import train_tokenizer
from needle_flows.paths import state_dir

ROOT = Path(__file__).resolve().parents[1]


def _newest_model() -> Path | None:
    """The newest tuned ``small`` model in the state dir's fine-tune folders (the main job's), or None."""
    found = []
    # <state>/finetune/<mode>-<digest>/model since the fine-tune folder is keyed by its inputs;
    # <state>/runs/<flow run>/lora-*/model before that.
    for path in [*state_dir().glob("finetune/lora-*/model"), *state_dir().glob("runs/*/lora-*/model")]:
        try:
            if json.loads((path / "config.json").read_text()).get("preset") == "small":
                found.append(path)
        except (OSError, ValueError):
            continue
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _random_small(out: Path, max_len: int | None = None) -> Path:
    rows, _ = read_rows(str(ROOT / "data/sample/new.jsonl"))
    tok = train_tokenizer([render_text(r) for r in rows[:2000]], 1024)
    cfg = model_preset("small", vocab_size=1024, **({"max_len": max_len} if max_len else {}))
    return save_model(out, init_params(cfg, None, 0), cfg, tok, {"random_init": True})


def _post(url: str, body: dict) -> float:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()
        assert resp.status == 200
    return time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def decode_speed(model_dir: Path, n_rows: int) -> dict:
    """Constrained vs free rows/s on held-out rows (warm: the second evaluation of each)."""
    rows, _ = read_rows(str(ROOT / "data/sample/new.jsonl"))
    held = rows[-n_rows:]
    loaded = load_model(model_dir)
    evaluate_model(loaded, held[:8], EvalConfig())  # compile both paths' shapes once
    res = evaluate_model(loaded, held, EvalConfig())
    m = res.metrics
    keys = ("parse_rate", "valid_call_rate", "exact_match", "tool_name_accuracy", "offtopic_accuracy")
    return {"rows": len(held), "free_rows_per_s": res.rows_per_s, "constrained_rows_per_s": m["constrained_rows_per_s"],
            "free": {k: m[k] for k in keys}, "constrained": {k: m[f"constrained_{k}"] for k in keys},
            "constrained_n_steered": m["constrained_n_steered"]}  # fmt: skip


def _conversations(rows: list[dict], turns: int, n: int, skip: int) -> list[list[list[dict]]]:
    """``n`` conversations of ``turns`` user turns from the sample's conversation ``rows`` (from
    ``skip`` on), each as the message lists a client sends turn by turn."""
    system = {"role": "system", "content": "You are the assistant of a phone: call a tool when one fits, else answer."}
    out = []
    for c in range(n):
        history, requests = [system], []
        for t in range(turns):
            messages = _renumber(rows[(skip + c * turns + t) % len(rows)]["messages"], f"t{t}_")
            requests.append([*history, messages[0]])
            history += messages
        out.append(requests)
    return out


def _renumber(messages: list[dict], prefix: str) -> list[dict]:
    """``messages`` with their tool-call ids made unique in the joined conversation (each sample
    conversation numbers its own from call_1)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "id": prefix + c["id"]} for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            m["tool_call_id"] = prefix + m["tool_call_id"]
        out.append(m)
    return out


def _time_last_turns(predictor: Any, rows: list[dict], tools: list[dict], turns: int, n: int) -> tuple[dict, list]:
    """Send each conversation's turns as a client would, timing the last one: p50/p95 latency,
    the cache's reuse when it has one, and the last turns' replies."""
    def ask(messages: list[dict]) -> Any:
        return predictor.predict([Request(messages=messages, tools=tools, mode="auto")])

    for conversation in _conversations(rows, turns, 4, skip=300):  # warm-up: compiles the shapes
        for messages in conversation:
            ask(messages)
    latencies, replies = [], []
    for conversation in _conversations(rows, turns, n, skip=0):
        for messages in conversation[:-1]:  # the turns before, as the client sent them
            ask(messages)
        start = time.perf_counter()
        replies.append(ask(conversation[-1]))
        latencies.append(time.perf_counter() - start)
    got = {"latency_p50_s": statistics.median(latencies), "latency_p95_s": _pct(latencies, 0.95)}
    if predictor.prefix_cache is not None:
        stats = predictor.prefix_cache.stats()
        got |= {"reused_token_share": stats["hit_tokens"] / stats["prompt_tokens"], "cache_bytes": stats["bytes"]}
    return got, replies


def prefix_speed(n_conversations: int, work: Path, turns: tuple[int, ...] = (1, 3, 6)) -> dict:
    """The last turn's latency with the prefix cache off and on (module doc)."""
    loaded = load_model(_random_small(work / "small-2048", max_len=2048))
    tools = [t.schema() for t in NEW_TOOLS]
    lines = (ROOT / "data/sample/new.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "messages" in r]
    result: dict[str, Any] = {"model": "random-init small, max_len 2048", "tools": len(tools),
                              "conversations": n_conversations, "cache_mb": DEFAULT_PREFIX_CACHE_MB}  # fmt: skip
    # first_token: a budget of one token (prefill and one step, what the cache shortens); reply:
    # the default budget, whose decode steps the cache does not change.
    budgets = {"first_token": EvalConfig(max_new_tokens=1), "reply": None}
    for k in turns:
        entry: dict[str, Any] = {}
        for what, cfg in budgets.items():
            replies = {}
            for label, mb in (("off", 0.0), ("on", DEFAULT_PREFIX_CACHE_MB)):
                predictor = Predictor(loaded, cfg, prefix_cache_mb=mb)
                entry.setdefault(what, {})[label], replies[label] = _time_last_turns(predictor, rows, tools, k,
                                                                                     n_conversations)  # fmt: skip
            entry[what]["p50_speedup"] = entry[what]["off"]["latency_p50_s"] / entry[what]["on"]["latency_p50_s"]
            entry[what]["same_replies"] = sum(a == b for a, b in zip(replies["off"], replies["on"]))
        last = Request(messages=_conversations(rows, k, 1, skip=0)[0][-1], tools=tools, mode="auto")
        entry["prompt_tokens_last_turn"] = len(predictor._prompt(last, 0)[0])
        result[f"turns_{k}"] = entry
        for what in budgets:
            e = entry[what]
            print(f"{k} turns ({entry['prompt_tokens_last_turn']} tokens), {what}: off p50 {e['off']['latency_p50_s']:.3f} s "
                  f"p95 {e['off']['latency_p95_s']:.3f} s; on p50 {e['on']['latency_p50_s']:.3f} s p95 "
                  f"{e['on']['latency_p95_s']:.3f} s ({e['p50_speedup']:.2f}x, {e['same_replies']}/{n_conversations} "
                  "replies equal)", flush=True)  # fmt: skip
    return result


def compare_libs(n_sets: int = 32) -> dict:
    """Compile time per tool set and mask time per token of each installed grammar library, on
    needle's BPE (vocab 1024) and the sample's tool sets, teacher-forcing the reference answers."""
    import importlib.util

    import numpy as np

    rows, _ = read_rows(str(ROOT / "data/sample/new.jsonl"))
    tok = train_tokenizer([render_text(r) for r in rows[:2000]], 1024)
    vocab, seen, picked = tok.vocab_size, set(), []
    for r in rows:
        key = tuple(t["name"] for t in r.tools)
        if key not in seen and len(picked) < n_sets:
            seen.add(key)
            picked.append(r)
    schemas = [json.dumps(call_list_schema(r.tools)) for r in picked]
    targets = [tok.encode(json.dumps(r.answers, separators=(",", ":"))) for r in picked]
    n_tok = sum(map(len, targets))
    out: dict = {"tool_sets": len(picked), "tokens": n_tok}

    def run(make, fill, advance) -> dict:
        t = time.perf_counter()
        ms = [make(s) for s in schemas]
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        for step in range(max(map(len, targets))):
            for i, m in enumerate(ms):
                if step < len(targets[i]):
                    fill(m, i)
                    advance(m, targets[i][step])
        return {"compile_ms_per_tool_set": compile_s / len(ms) * 1e3,
                "mask_us_per_token": (time.perf_counter() - t) / n_tok * 1e6}  # fmt: skip

    if importlib.util.find_spec("llguidance"):
        import llguidance as llg
        from llguidance.numpy import fill_next_token_bitmask

        lt = llg.LLTokenizer(tok.to_json(), n_vocab=vocab, eos_token=[tok.end_id])
        bits = np.zeros((len(schemas), (vocab + 31) // 32), np.int32)
        spacing = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        out["llguidance"] = run(
            lambda s: llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema({**json.loads(s), "x-guidance": spacing})),
            lambda m, i: fill_next_token_bitmask(m, bits, i), lambda m, t: m.consume_token(t))  # fmt: skip
    if importlib.util.find_spec("xgrammar"):
        import xgrammar as xgr

        vocab_list = [""] * vocab
        for text, i in tok._raw.get_vocab(with_added_tokens=True).items():  # noqa: SLF001
            vocab_list[i] = text
        info = xgr.TokenizerInfo(vocab_list, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                 stop_token_ids=[tok.end_id])  # fmt: skip
        comp = xgr.GrammarCompiler(info, max_threads=1)
        xbits = xgr.allocate_token_bitmask(len(schemas), vocab)
        out["xgrammar"] = run(
            lambda s: xgr.GrammarMatcher(comp.compile_json_schema(s, any_whitespace=False, separators=(",", ":"))),
            lambda m, i: m.fill_next_token_bitmask(xbits, i), lambda m, t: m.accept_token(t))  # fmt: skip
    if importlib.util.find_spec("outlines_core"):
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        table: dict[str, list[int]] = {}
        for i in range(9, vocab):
            table.setdefault(tok.decode([i]), []).append(i)
        voc = Vocabulary(tok.end_id, table)
        obits = np.zeros((len(schemas), (vocab + 31) // 32), np.int32)
        out["outlines_core"] = run(
            lambda s: Guide(Index(build_regex_from_schema(s, whitespace_pattern=""), voc)),
            lambda m, i: m.write_mask_into(obits[i].ctypes.data, obits.shape[1], 4), lambda m, t: m.advance(t))  # fmt: skip
    return out


def _start_server(pyfunc_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str, float]:
    """`needle serve` (MLflow's scoring app plus the OpenAI route) on a free port; (process, url, start s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "needle.cli", "serve", str(pyfunc_dir), "--host", "127.0.0.1", "--port", str(port)]
    log = open(log_path, "w")
    started = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5):
                return server, url, time.perf_counter() - started
        except OSError:
            if server.poll() is not None or time.perf_counter() - started > 300:
                _stop(server)
                raise RuntimeError(log_path.read_text()[-2000:]) from None
            time.sleep(0.5)


def _stop(server: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
            server.wait(timeout=20)
            break
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _measure(post: Any, bodies: list[Any]) -> dict[str, float]:
    """One client (p50/p95) then four concurrent clients (requests/s, p50/p95), each after a warm-up."""
    for body in bodies[:3]:  # warm-up, not measured: the decode shapes of one row and of batched rows
        post(body)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(post, bodies))
    single = [post(b) for b in bodies]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        conc = list(pool.map(post, bodies))
    conc_wall = time.perf_counter() - t0
    return {"latency_p50_s": statistics.median(single), "latency_p95_s": _pct(single, 0.95),
            "concurrent_clients": 4, "concurrent_requests_per_s": len(conc) / conc_wall,
            "concurrent_latency_p50_s": statistics.median(conc), "concurrent_latency_p95_s": _pct(conc, 0.95)}  # fmt: skip


def _openai_post(url: str) -> Any:
    """A timed ``chat.completions.create`` of the real OpenAI client library (one client object per thread)."""
    import threading

    from openai import OpenAI

    local = threading.local()

    def post(body: dict) -> float:
        if not hasattr(local, "client"):
            local.client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        start = time.perf_counter()
        local.client.chat.completions.create(model="needle", **body)
        return time.perf_counter() - start

    return post


def serving_speed(model_dir: Path, n_requests: int, work: Path) -> dict:
    """Both request shapes against `needle serve` of ``model_dir``: the table shape on MLflow's
    ``/invocations`` (urllib) and the chat shape through the OpenAI client library."""
    pyfunc_dir = save_pyfunc(model_dir, work / "pyfunc")
    rows, _ = read_rows(str(ROOT / "data/sample/new.jsonl"))
    picked = rows[-n_requests:]
    table = [{"dataframe_records": [{"query": r.query, "tools": json.dumps(r.tools)}]} for r in picked]
    chat = [{"messages": [{"role": "user", "content": r.query}],
             "tools": [{"type": "function", "function": t} for t in r.tools]} for r in picked]  # fmt: skip
    server, url, start_s = _start_server(pyfunc_dir, work / "serve.log")
    try:
        by_table = _measure(lambda b: _post(f"{url}/invocations", b), table)
        by_chat = _measure(_openai_post(url), chat)
    finally:
        _stop(server)
    return {"server": "needle serve (MLflow scoring app + /v1/chat/completions), one process",
            "server_start_s": start_s, "requests": len(picked), "constrained": True,
            "table": {"route": "/invocations", "client": "urllib, one query per request", **by_table},
            "openai": {"route": "/v1/chat/completions", "client": "openai.OpenAI().chat.completions.create",
                       **by_chat}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--libs", action="store_true", help="compare the grammar libraries instead")
    ap.add_argument("--model", default=None, help="a needle model dir or models:/ URI (default: the newest under .state/finetune)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--eval-rows", type=int, default=100)
    ap.add_argument("--prefix", action="store_true", help="measure the prefix cache alone")
    ap.add_argument("--conversations", type=int, default=12, help="conversations per length for --prefix")
    ap.add_argument("--out", default=None, help="default: bench/results/serve.json (serve_prefix.json with --prefix)")
    args = ap.parse_args(argv)
    if args.libs:
        print(json.dumps(compare_libs(), indent=2))
        return 0
    stamp = {"machine": f"{os.cpu_count()} cores", "load_avg": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}
    if args.prefix:
        work = Path(tempfile.mkdtemp(prefix="needle-serve-"))
        result = {**prefix_speed(args.conversations, work), **stamp}
        _write(Path(args.out or ROOT / "bench/results/serve_prefix.json"), result)
        return 0

    work = Path(tempfile.mkdtemp(prefix="needle-serve-"))
    model_dir = Path(local_model_dir(args.model)) if args.model else _newest_model()
    source = args.model or (str(model_dir) if model_dir else "random-init small (no trained model found)")
    if model_dir is None:
        model_dir = _random_small(work / "small")
    result = {"model": source, **serving_speed(model_dir, args.requests, work),
              "decode": decode_speed(model_dir, args.eval_rows),
              "prefix": prefix_speed(args.conversations, work), **stamp}  # fmt: skip
    _write(Path(args.out or ROOT / "bench/results/serve.json"), result)
    return 0


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
