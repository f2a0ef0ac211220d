"""The trainer's forward pass makes logits only where they are used: the lm head runs on the positions
that predict the response (``logits_to_keep``), and the float32 upcast and the temperature happen a chunk
of rows at a time (``benchmarks/train_memory.py`` measures what that saves at a 152k vocabulary)."""

from __future__ import annotations

import torch

from roll.data.batch import Batch
from roll.data.padding import position_ids_from_mask
from roll.strategies.hf_forward import response_logprobs


def test_response_logprobs_equal_the_full_logits_and_the_head_sees_only_the_response(model) -> None:
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    batch = Batch(
        tensors={
            "prompt_ids": torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]]),  # left-padded
            "prompt_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
            "response_ids": torch.randint(4, vocab, (2, 4)),
            "response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),  # right-padded: 3 columns used
        }
    )
    head_inputs = []
    model.lm_head.register_forward_hook(lambda module, args, out: head_inputs.append(args[0].shape))
    with torch.no_grad():
        logprobs, entropy = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    assert head_inputs == [torch.Size([2, 3, model.config.hidden_size])]  # the 3 response columns, not 8

    # By hand from every position's logits (positions 4..6 predict the response's first 3 tokens).
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
        positions = position_ids_from_mask(mask)
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, 4:7] / 0.7
    expected = torch.log_softmax(full, -1).gather(-1, batch["response_ids"][:, :3, None]).squeeze(-1)
    expected_entropy = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)
    used = batch["response_mask"][:, :3].float()
    assert torch.allclose(logprobs[:, :3], expected * used, atol=1e-5)
    assert torch.allclose(entropy[:, :3], expected_entropy * used, atol=1e-5)
    assert logprobs.shape == (2, 4) and not logprobs[:, 3].any()  # padded back to the batch's width
