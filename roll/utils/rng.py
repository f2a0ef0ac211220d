"""Every random number generator a process draws from, captured and restored as one value: what makes
a resumed run draw the same samples as one that never stopped."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The states of Python's ``random``, NumPy's global generator, torch's CPU generator and, where
    present, every CUDA device's generator."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore(state: dict[str, Any]) -> None:
    """Put back what ``capture`` returned (in this process or another one of the same role and rank)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
