"""Trackers that log to a service of their own: Weights & Biases and MLflow (extras ``wandb``, ``mlflow``).

Importing this registers them in ``roll.tracking.TRACKER_BACKENDS``; their libraries are imported only when
a run uses them.
"""

from roll.trackers.mlflow_tracker import MlflowBackend
from roll.trackers.wandb_tracker import WandbBackend

__all__ = ["MlflowBackend", "WandbBackend"]
