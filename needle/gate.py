"""The gate: one fixed, versioned held-out set and the rule that decides whether a challenger
replaces the champion.

Both models are scored on the same gate rows with the same decoding settings in the same run
(``needle.pipeline.score_models``); numbers from another gate set are never compared, the
champion is scored again instead. The gate's fingerprint (its rows' content digest and the
decoding settings) is recorded with every decision.

    rule = GateRule(metric="exact_match", margin=0.0, guarded={"valid_call_rate": 0.02})
    verdict = decide(challenger_scores, champion_scores, rule)   # champion_scores None: no champion
    verdict.promote, verdict.reason, verdict.checks

The default gate set, ``data/sample/gate.jsonl``, is held out from the bundled new-tool rows:
drawn from the sample generator with its own seed, every row whose query also appears in
``new.jsonl`` left out, so no training split contains a gate row. It is a fixed file, not
regenerated with the sample: a gate that moved with the generator would not be a fixed yardstick.
If ``new.jsonl`` is ever regenerated and overlaps it (tests/test_gate.py checks), rebuild it
with ``python -m needle.gate``; its fingerprint changes and every champion is re-scored anyway.
Pure: no Prefect, no MLflow.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from needle.data.sample import generate_rows, write_rows
from needle.pipeline import score_models

GATE_SEED = 7919  # the gate's own sample seed: never one the training sample uses
GATE_ROWS = 200
DEFAULT_GATE = "data/sample/gate.jsonl"
DEFAULT_GUARDED = {"valid_call_rate": 0.02, "tool_name_accuracy": 0.02, "offtopic_accuracy": 0.05}
# Reported in the decision table besides the primary and guarded metrics.
REPORTED = ("exact_match", "tool_name_accuracy", "valid_call_rate", "parse_rate", "arg_f1", "offtopic_accuracy")


class GateRule(BaseModel):
    """Promote when ``metric`` >= the champion's + ``margin`` and no ``guarded`` metric is worse
    than the champion's by more than its tolerance (all metrics: higher is better)."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field("exact_match", description="the metric the challenger must win on")
    margin: float = Field(0.0, ge=0.0, description="how much the challenger must add to the champion's metric")
    guarded: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_GUARDED),
        description="metric -> largest drop allowed against the champion (higher is better)",
    )


@dataclass(frozen=True)
class Check:
    """One clause of the rule on one metric."""

    metric: str
    challenger: float | None
    champion: float | None
    threshold: float | None  # the challenger's value must be >= this
    ok: bool
    kind: str  # "primary" or "guarded"


@dataclass(frozen=True)
class GateDecision:
    """The rule's verdict: promote or not, one line why, and every check."""

    promote: bool
    reason: str
    checks: list[Check] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{'promoted' if self.promote else 'rejected'}: {self.reason}"


def _num(value: Any) -> float | None:
    if value in (None, "", "None"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def decide(challenger: dict[str, Any], champion: dict[str, Any] | None, rule: GateRule) -> GateDecision:
    """Apply ``rule`` to two score sets taken on the same gate set; ``champion`` None: no champion.

    A guarded metric that neither model has (no off-topic rows in the gate) is not checked; one
    the challenger lacks but the champion has fails.
    """
    if champion is None:
        return GateDecision(True, "no champion yet")
    checks = []
    new, old = _num(challenger.get(rule.metric)), _num(champion.get(rule.metric))
    if old is None:
        checks.append(Check(rule.metric, new, old, None, new is not None, "primary"))
    else:
        need = old + rule.margin
        checks.append(Check(rule.metric, new, old, need, new is not None and new >= need - 1e-12, "primary"))
    for metric, tolerance in rule.guarded.items():
        new_g, old_g = _num(challenger.get(metric)), _num(champion.get(metric))
        if old_g is None:
            continue
        need = old_g - tolerance
        checks.append(Check(metric, new_g, old_g, need, new_g is not None and new_g >= need - 1e-12, "guarded"))
    failed = [c for c in checks if not c.ok]
    if not failed:
        p = checks[0]
        return GateDecision(True, f"{rule.metric} {_fmt(p.challenger)} >= {_fmt(p.threshold)} "
                                  f"(champion {_fmt(p.champion)} + margin {rule.margin:g}), no guarded metric "
                                  f"worse beyond tolerance", checks)  # fmt: skip
    why = "; ".join(f"{c.metric} {_fmt(c.challenger)} < {_fmt(c.threshold)} ({c.kind}, champion {_fmt(c.champion)})"
                    for c in failed)  # fmt: skip
    return GateDecision(False, why, checks)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def gate_fingerprint(gate_digest: str, decoding: dict[str, Any]) -> str:
    """What makes two gate scores comparable: the gate rows' content digest and the decoding
    settings (max_new_tokens, max_rows, ...)."""
    blob = json.dumps({"gate": gate_digest, "decoding": decoding}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class GateOutcome:
    """A gate run: the set's fingerprint, both score sets, the champion's version, the verdict."""

    fingerprint: str
    gate_digest: str
    n_rows: int
    challenger: dict[str, Any]
    champion: dict[str, Any] | None
    champion_version: str | None
    decision: GateDecision
    report_dir: Path

    def version_tags(self) -> dict[str, Any]:
        """Tags for the challenger's model version: gate identity, both score sets, the verdict."""
        tags: dict[str, Any] = {"gate_fingerprint": self.fingerprint, "gate_digest": self.gate_digest,
                                "gate.n_rows": self.n_rows, "decision": self.decision.label,
                                "gate.champion_version": self.champion_version or "none"}  # fmt: skip
        tags.update({f"gate.{m}": v for m, v in self.challenger.items() if m in _TAGGED})
        tags.update({f"gate.champion.{m}": v for m, v in (self.champion or {}).items() if m in _TAGGED})
        return tags

    def champion_tags(self) -> dict[str, Any]:
        """Tags for the champion's version: its scores on this gate (re-scored here)."""
        if self.champion is None:
            return {}
        return {"gate_fingerprint": self.fingerprint, "gate_digest": self.gate_digest, "gate.n_rows": self.n_rows,
                **{f"gate.{m}": v for m, v in self.champion.items() if m in _TAGGED}}  # fmt: skip


_TAGGED = (*REPORTED, "offtopic_call_rate", "arg_precision", "arg_recall", "n")


def run_gate(challenger_dir: str, champion: tuple[str, str] | None, gate_rows: Any, cfg: Any, rule: GateRule,
             out_dir: str | Path) -> GateOutcome:  # fmt: skip
    """Score the challenger and the champion (``(version, model_dir)`` or None) on the gate rows
    (a ``LoadedSource``) with the same decoding settings ``cfg``, and apply ``rule``."""
    models = {"challenger": challenger_dir, **({"champion": champion[1]} if champion else {})}
    scores = score_models(models, gate_rows, cfg, out_dir)
    decision = decide(scores["challenger"], scores.get("champion"), rule)
    decoding = cfg.model_dump(mode="json")
    n_rows = int(scores["challenger"].get("n") or len(gate_rows.rows))  # eval.max_rows may cap it
    outcome = GateOutcome(gate_fingerprint(gate_rows.digest, decoding), gate_rows.digest, n_rows,
                          scores["challenger"], scores.get("champion"), champion[0] if champion else None,
                          decision, Path(out_dir))  # fmt: skip
    table = decision_table(outcome.challenger, outcome.champion, decision)
    (Path(out_dir) / "decision.json").write_text(json.dumps(
        {"decision": decision.label, "promote": decision.promote, "rule": rule.model_dump(),
         "gate_fingerprint": outcome.fingerprint, "gate_digest": outcome.gate_digest, "decoding": decoding,
         "champion_version": outcome.champion_version, "table": table}, indent=2) + "\n")  # fmt: skip
    return outcome


def decision_table(challenger: dict[str, Any], champion: dict[str, Any] | None,
                   decision: GateDecision) -> list[dict[str, Any]]:  # fmt: skip
    """Rows for a table artifact: each reported or checked metric, both scores, the delta, the
    threshold and whether the check held."""
    by_metric = {c.metric: c for c in decision.checks}
    metrics = list(dict.fromkeys([*by_metric, *REPORTED]))
    rows = []
    for m in metrics:
        new, old = _num(challenger.get(m)), _num((champion or {}).get(m))
        check = by_metric.get(m)
        rows.append({
            "metric": m, "challenger": _fmt(new), "champion": _fmt(old),
            "delta": _fmt(new - old) if new is not None and old is not None else "-",
            "rule": f"{check.kind} >= {_fmt(check.threshold)}" if check else "reported",
            "ok": "-" if check is None else ("yes" if check.ok else "NO"),
        })  # fmt: skip
    return rows


def user_queries(row: Any) -> list[str]:
    """Every user message of a row (a JSON dict or a validated ``Row``): a conversation shows
    the model each of its turns, so each can leak a gate query."""
    get = row.get if isinstance(row, dict) else lambda key: getattr(row, key)
    messages = get("messages")
    if messages:
        return [m["content"] for m in messages if m["role"] == "user"]
    return [get("query")]


def overlap_count(training_rows: list[Any], gate_rows: list[Any]) -> int:
    """Gate rows whose query also appears in the training rows, in any turn: a gate that
    leaks into training flatters every model trained on it; the flow tags the count."""
    seen = {q for r in training_rows for q in user_queries(r)}
    return sum(any(q in seen for q in user_queries(r)) for r in gate_rows)


def held_out_rows(n: int, training_rows: list[dict[str, Any]], seed: int = GATE_SEED) -> list[dict[str, Any]]:
    """``n`` new-tool rows of the sample generator (seed ``seed``) whose queries appear in none
    of ``training_rows`` and in no earlier gate row."""
    seen = {q for r in training_rows for q in user_queries(r)}
    out: list[dict[str, Any]] = []
    drawn = 0
    while len(out) < n:
        batch = generate_rows(drawn + 4 * n, "new", seed)[drawn:]  # same seed: a longer prefix
        drawn += len(batch)
        for row in batch:
            if row["query"] not in seen and len(out) < n:
                seen.add(row["query"])
                out.append(row)
        if drawn > 200 * n:
            raise ValueError(f"cannot draw {n} held-out rows: the generator repeats the training queries")
    return out


def write_gate_sample(out: str | Path, training: str | Path, n: int = GATE_ROWS, seed: int = GATE_SEED) -> Path:
    """Write the held-out gate set for the rows in ``training`` (the bundled ``new.jsonl``)."""
    rows = [json.loads(line) for line in Path(training).read_text(encoding="utf-8").splitlines() if line.strip()]
    return write_rows(out, held_out_rows(n, rows, seed))


if __name__ == "__main__":
    print(write_gate_sample(DEFAULT_GATE, "data/sample/new.jsonl"))
