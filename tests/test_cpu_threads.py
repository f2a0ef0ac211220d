"""Decode thread counts: one thread for a narrow model on the CPU, every thread otherwise."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from roll.strategies.cpu_threads import (
    SINGLE_THREAD_DECODE_BELOW_HIDDEN,
    decode_threads,
    threads_for_decoding,
)


def _model(hidden: int | None) -> torch.nn.Module:
    module = torch.nn.Linear(2, 2)
    module.config = SimpleNamespace(hidden_size=hidden) if hidden is not None else SimpleNamespace()
    return module


def test_narrow_models_decode_on_one_cpu_thread_and_wide_ones_on_all() -> None:
    narrow, wide = SINGLE_THREAD_DECODE_BELOW_HIDDEN - 1, SINGLE_THREAD_DECODE_BELOW_HIDDEN
    assert decode_threads(_model(narrow), "cpu", 8) == 1
    assert decode_threads(_model(wide), "cpu", 8) == 8
    assert decode_threads(_model(896), "cpu", 8) == 8  # Qwen2.5-0.5B's width
    assert decode_threads(_model(narrow), "cuda", 8) == 8  # on an accelerator the count drives the host
    assert decode_threads(_model(None), "cpu", 8) == 8  # no known width: leave the count alone


def test_the_count_is_restored_after_decoding() -> None:
    before = torch.get_num_threads()
    seen = []

    def run() -> None:
        torch.set_num_threads(2)
        with threads_for_decoding(_model(32), "cpu"):
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)  # the count is per thread: leave the test's own alone
    thread.start()
    thread.join()
    assert seen == [1, 2]
    assert torch.get_num_threads() == before


def test_the_engine_serves_a_narrow_model_on_one_thread(model, tokenizer) -> None:
    from roll.strategies.infer.hf import HFEngine

    assert model.config.hidden_size < SINGLE_THREAD_DECODE_BELOW_HIDDEN
    engine = HFEngine(model, tokenizer, "cpu")
    try:
        assert engine._num_threads == 1
    finally:
        engine.shutdown()
