"""The eval tests' fixtures (sample rows, their tokenizer, a saved tiny model) for the serving tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_eval_conftest", Path(__file__).parents[1] / "eval" / "conftest.py")
_eval = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_eval)  # type: ignore[union-attr]

eval_rows = _eval.eval_rows
eval_tokenizer = _eval.eval_tokenizer
tiny_model_dir = _eval.tiny_model_dir
