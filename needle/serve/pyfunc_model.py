"""The MLflow ``python_function`` model of a needle model, as code ("models from code": no pickle).

MLflow copies this file into the logged model and runs it on load; ``set_model`` names the
model object. Its artifact ``model`` is the exported needle model directory (params, config,
tokenizer, meta); ``load_context`` reads it with ``needle.model.io.load_model``. The request
shapes and the answers are ``needle.serve.requests`` (see its doc); saving and logging are
``needle.serve.pyfunc``.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import pandas as pd
from mlflow.models import set_model

from needle.model.io import load_model
from needle.serve.engine import Predictor
from needle.serve.requests import answer


class NeedleToolCaller(mlflow.pyfunc.PythonModel):
    """Tool calls for queries (table shape) or an OpenAI-style chat request."""

    def load_context(self, context: Any) -> None:
        self.predictor = Predictor(load_model(context.artifacts["model"]))
        self.name = str(self.predictor.loaded.meta.get("name") or "needle")

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> Any:
        """``model_input``: the table (MLflow builds it from the request with the logged signature).

        ``pd.DataFrame`` is the hint MLflow reads as "no schema from the hints": the explicit
        signature (needle.serve.pyfunc.signature) stays the one that validates requests, and the
        input reaches ``answer`` as MLflow passes it (a dict too, called directly).
        """
        return answer(self.predictor, model_input, params or {}, model_name=self.name)


set_model(NeedleToolCaller())
