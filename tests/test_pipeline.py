"""The pipeline stages (needle.pipeline) on their own: defaults, caching, the auto base, the champion rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from needle import pipeline
from needle.config import DataConfig, training_configs
from needle.registry import decide_registration
from needle.tracking.tracker import MemoryTracker as RecordingTracker, PrefixedTracker

ROOT = Path(__file__).resolve().parents[1]


def test_training_configs_merge_defaults_dicts_and_shortcuts_once() -> None:
    train, optim = training_configs("lora")
    assert (train.mode, train.steps, train.batch_size, optim.lr, optim.warmup_steps) == ("lora", 600, 16, 5e-3, 20)
    train, optim = training_configs("scratch", steps=7, seed=3, train={"steps": 9, "log_every": 2}, optim={"lr": 1e-4})
    assert (train.steps, train.seed, train.log_every, optim.lr, optim.warmup_steps) == (7, 3, 2, 1e-4, 50)
    assert training_configs("full", train={"steps": 9})[0].steps == 9
    with pytest.raises(ValueError, match="mode"):
        training_configs("lora", train={"mode": "full"})
    with pytest.raises(ValueError, match="unknown mode"):
        training_configs("prefix")


def test_champion_rule() -> None:
    assert decide_registration({"exact_match": 0.5}, None).champion
    assert decide_registration({"exact_match": 0.5}, {"exact_match": "0.5"}).champion
    assert not decide_registration({"exact_match": 0.4}, {"exact_match": "0.5"}).champion
    assert not decide_registration({}, {"exact_match": "0.5"}).champion
    assert decide_registration({}, {"exact_match": "None"}).champion
    verdict = decide_registration({"exact_match": 0.7}, {"exact_match": "0.5"})
    assert (verdict.candidate, verdict.incumbent, verdict.metric) == (0.7, 0.5, "exact_match")


def test_prefixed_tracker_prefixes_every_key() -> None:
    inner = RecordingTracker()
    tracker = PrefixedTracker(inner, "base/")
    tracker.log_params({"train.steps": 4})
    tracker.log_metrics({"loss": 1.0}, step=2)
    assert inner.params == {"base/train.steps": 4} and inner.metrics == [(2, {"base/loss": 1.0})]


def test_prepare_data_validates_once_and_caches_by_content(sample_data: dict[str, Path], tmp_path: Path) -> None:
    source = pipeline.load_data(str(sample_data["new"]))
    cfg = DataConfig(source=str(sample_data["new"]), max_len=256)
    first = pipeline.prepare_data(cfg, source, vocab_size=1024, cache_dir=tmp_path)
    again = pipeline.prepare_data(cfg, source, vocab_size=1024, cache_dir=tmp_path)
    assert not first.cached and again.cached and again.directory == first.directory
    assert again.fingerprint == first.fingerprint and again.tokenizer.to_json() == first.tokenizer.to_json()
    assert again.data.splits["train"]["ids"] == first.data.splits["train"]["ids"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.directory.name]  # no temp dir left
    # With that tokenizer given, it is another key: the same rows, prepared once more.
    given = pipeline.prepare_data(cfg, source, tokenizer=first.tokenizer, cache_dir=tmp_path)
    assert not given.cached and given.directory != first.directory and given.fingerprint == first.fingerprint


def test_needle_imports_no_shell_and_the_cli_keeps_working() -> None:
    code = ("import sys, needle.cli, needle.pipeline, needle.registry, needle.tracking.tracker; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'needle_flows', 'needle_tasks', 'flows', 'tasks', 'mlflow')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    helps = [subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
             for module in ("needle.cli", "needle_flows.cli")]
    assert all(h.returncode == 0 for h in helps)
    assert "finetune" not in helps[0].stdout and "finetune" in helps[1].stdout and "train" in helps[1].stdout


@pytest.mark.slow
def test_auto_base_is_trained_once_and_replayed(sample_data: dict[str, Path], tmp_path: Path) -> None:
    from needle.config import model_preset

    model = model_preset("tiny")
    train, optim = training_configs("scratch", steps=2, batch_size=8, train={"log_every": 1})
    auto = pipeline.AutoBase(DataConfig(source=str(sample_data["base"])), model, train, optim)
    trained, reused = RecordingTracker(), RecordingTracker()
    first = pipeline.obtain_base("auto", auto=auto, state_dir=tmp_path, tracker=trained)
    second = pipeline.obtain_base("auto", auto=auto, state_dir=tmp_path, tracker=reused)
    assert (first.cached, second.cached) == (False, True) and first.model_dir == second.model_dir
    assert first.model_cfg == second.model_cfg == model
    assert trained.params["base/train.mode"] == "scratch" and set(reused.params) == set(trained.params)
    assert [s for s, _ in reused.metrics] == [s for s, _ in trained.metrics] == [1, 2]
    assert set(reused.metrics[-1][1]) == set(trained.metrics[-1][1])
    record = json.loads((Path(first.model_dir).parent / "base.json").read_text())
    assert record["fingerprint"] == first.record["fingerprint"]
    with pytest.raises(ValueError, match="preset"):
        pipeline.obtain_base(first.model_dir, preset="small")


@pytest.mark.slow
def test_the_smallest_preset_takes_the_bundled_sample_whole() -> None:
    """`needle finetune data/sample/new.jsonl --preset tiny`: with the auto base's tokenizer
    (trained on data/sample/base.jsonl at the preset's vocabulary) no row of the sample is
    longer than the preset's max_len, so none is refused."""
    from needle.config import model_preset

    tiny = model_preset("tiny")
    base = pipeline.prepare_data(DataConfig(source=str(ROOT / "data/sample/base.jsonl"), max_len=tiny.max_len),
                                 vocab_size=tiny.vocab_size)  # fmt: skip
    new = pipeline.prepare_data(DataConfig(source=str(ROOT / "data/sample/new.jsonl"), max_len=tiny.max_len),
                                tokenizer=base.tokenizer)  # on_error fail: one longer row raises  # fmt: skip
    assert new.data.stats["dropped"] == 0 and new.data.stats["length"]["max"] <= tiny.max_len
    assert sum(new.data.stats["rows"].values()) == 4600  # 4,000 single-turn rows and 600 conversations
