"""Trackers that log to a service of their own: Weights & Biases and MLflow (extras ``wandb``, ``mlflow``).

Importing this package (``roll.tracking`` does) registers them in ``TRACKER_BACKENDS``
(``roll.trackers.base``); their libraries are imported only when a run uses them.
"""

from roll.trackers.mlflow_tracker import MlflowBackend
from roll.trackers.wandb_tracker import WandbBackend

__all__ = ["MlflowBackend", "WandbBackend"]
