"""ROLL: reinforcement learning for large language models."""

import os

# Set before torch loads OpenMP (it reads the variable once): the controller and its workers run the
# stages of a step one after another, and OpenMP threads that spin after a parallel region (their
# default) take the cores from whoever runs next. docs/performance.md has the measurement.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
