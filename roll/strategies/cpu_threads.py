"""How many CPU threads a decode loop should use.

Below a model width of ``SINGLE_THREAD_DECODE_BELOW_HIDDEN`` a CPU decode step is a chain of tiny
kernels whose cost is the OpenMP team's hand-offs, not arithmetic, and one thread decodes faster than
several; from that width on, more threads win (docs/performance.md has the measurements). Training keeps
every thread: its kernels are wider (every token of the batch at once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SINGLE_THREAD_DECODE_BELOW_HIDDEN = 256


def decode_threads(model: torch.nn.Module, device: torch.device | str, available: int) -> int:
    """The thread count for decoding with ``model`` on ``device``, out of ``available``: one for a
    narrow model on the CPU, ``available`` otherwise (on an accelerator the count only drives the host)."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    narrow = isinstance(hidden, int) and hidden < SINGLE_THREAD_DECODE_BELOW_HIDDEN
    return 1 if narrow and torch.device(device).type == "cpu" else available


@contextlib.contextmanager
def threads_for_decoding(model: torch.nn.Module, device: torch.device | str) -> Iterator[None]:
    """Run the block on ``decode_threads`` threads (torch's count is per calling thread), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(decode_threads(model, device, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)
