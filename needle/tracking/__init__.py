"""Experiment tracking: ``tracker`` (the protocol, no-op, in-memory and prefixed trackers),
``mlflow_tracker`` (MLflow, buffered) and ``redaction`` (what every tracker strips or clips)."""
