"""Peak memory of the trainer's forward pass (and its backward) at a real vocabulary (151,936, Qwen2's).

The training-side companion of ``generation_memory.py``. Each (path, pass) runs in its own process, so each
peak RSS is that run's alone:

- ``before``: the forward as it was (issue 41): logits over prompt and response, then a float32 copy of
  them, then a temperature-scaled copy, then ``logprobs_from_logits``.
- ``logits``: the forward as it was before the streamed head (issue 60): the head only on the positions
  that predict the response (``logits_to_keep``), their logits upcast and divided by the temperature a
  chunk of rows at a time, but the bf16 logits of every response position, and their gradient, whole.
- ``now``: ``roll.strategies.hf_forward.response_logprobs`` with the streamed head
  (``roll.strategies.streaming_head``): a chunk of rows' logits at a time, in forward and backward.

Passes: ``logprobs`` (no grad: old and reference logprobs), ``train`` (forward and backward of the
mean response logprob: a train step's memory without the optimizer) and ``distill`` (forward and
backward of the forward KL from a cached top-64 teacher with the extra class: offline distillation's
loss; before, ``student_on_support`` took a float32 copy of the logits and made two more of it).
The model is a random one-layer Qwen2 (hidden 64) in ``--dtype`` (bfloat16: the compute dtype of mixed
precision), so the logits dominate.

    python benchmarks/train_memory.py                      # 8 rows x (512 prompt + 512 response)
    python benchmarks/train_memory.py --prompt 128         # the same with shorter prompts

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from generation_memory import VOCAB, build_large_vocab_model  # this directory: run as a script

PATHS = ("before", "logits", "now")
PASSES = ("logprobs", "train", "distill")
TOP_K = 64


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def _old_logprobs_from_logits(logits, labels):
    """``roll.algorithms.functional.logprobs_from_logits`` at 965608d: float32 chunks of 1024 rows, each
    kept by autograd for the backward pass."""
    import torch

    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    chunks = []
    for start in range(0, flat_logits.shape[0], 1024):
        rows = flat_logits[start : start + 1024].float()
        picked = rows.gather(-1, flat_labels[start : start + 1024].unsqueeze(-1)).squeeze(-1)
        chunks.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(chunks).reshape(labels.shape)


def _before(model, batch, temperature: float):
    """The forward pass before issue 41 (hf_forward and its helper at 965608d), to measure against."""
    import torch

    from roll.data.padding import position_ids_from_mask

    prompt_length, length = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logits = logits[:, prompt_length - 1 : prompt_length - 1 + length].float()
    if temperature != 1.0:
        logits = logits / temperature
    return _old_logprobs_from_logits(logits, batch["response_ids"]) * batch["response_mask"]


def _distill_loss(path: str, model, batch, teacher_indices, teacher_logprobs):
    """The mean forward KL from the teacher's cached top-k (extra class) to the student."""
    import torch

    from roll.algorithms.distillation import forward_kl, student_on_support, support_logprobs
    from roll.data.padding import position_ids_from_mask
    from roll.strategies.hf_forward import response_logits

    if path == "now":  # the actor's loss terms, through the streamed head
        from roll.workers.actor_losses import DistillLossSpec, distill_terms

        micro = batch.select_keys(batch.tensors)
        micro["teacher_indices"], micro["teacher_logprobs"] = teacher_indices, teacher_logprobs
        divergence, _, _, mask = distill_terms(model, micro, DistillLossSpec(tail="extra_class"))
        return divergence.sum() / mask.sum()
    if path == "before":  # the actor's _distill_terms at 965608d
        prompt_length, length = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        logits = logits[:, prompt_length - 1 : prompt_length - 1 + length].float()
        student = support_logprobs(logits, teacher_indices, "extra_class")
    else:
        logits, _ = response_logits(model, batch)
        student = student_on_support(logits, teacher_indices, "extra_class")
    return forward_kl(teacher_logprobs, student).mean()


def run_one(path: str, which: str, model_path: str, args: argparse.Namespace) -> dict:
    import torch

    from roll.data.batch import Batch
    from roll.models.loading import load_causal_lm
    from roll.strategies.hf_forward import response_logprobs

    torch.set_num_threads(args.threads)
    model = load_causal_lm(model_path, dtype=args.dtype)
    generator = torch.Generator().manual_seed(0)
    batch = Batch(
        tensors={
            "prompt_ids": torch.randint(2, VOCAB, (args.rows, args.prompt), generator=generator),
            "prompt_mask": torch.ones(args.rows, args.prompt, dtype=torch.long),
            "response_ids": torch.randint(2, VOCAB, (args.rows, args.response), generator=generator),
            "response_mask": torch.ones(args.rows, args.response, dtype=torch.long),
        }
    )
    if path == "logits":
        import roll.strategies.hf_forward as hf_forward

        hf_forward.streamable_head = lambda model: None  # every path below materialises the logits
    forward = _before if path == "before" else (lambda m, b, t: response_logprobs(m, b, t)[0])
    # Distinct ids per position (a teacher's top-k) and a normalised distribution over k + 1 classes.
    offsets = torch.randint(0, VOCAB, (args.rows, args.response, 1), generator=generator)
    teacher_indices = (offsets + 997 * torch.arange(TOP_K)) % VOCAB
    teacher_logprobs = torch.log_softmax(
        torch.randn(args.rows, args.response, TOP_K + 1, generator=generator), -1
    )
    before = _rss_gb()
    start = time.perf_counter()
    if which == "distill":
        model.train()
        loss = _distill_loss(path, model, batch, teacher_indices, teacher_logprobs)
        loss.backward()
        logprobs = loss.detach()
    elif which == "logprobs":
        with torch.no_grad():
            logprobs = forward(model, batch, args.temperature)
    else:
        model.train()
        logprobs = forward(model, batch, args.temperature)
        (-logprobs.mean()).backward()
    return {
        "path": path,
        "pass": which,
        "rss_before_gb": round(before, 3),
        "peak_rss_gb": round(_rss_gb(), 3),
        "added_gb": round(_rss_gb() - before, 3),
        "seconds": round(time.perf_counter() - start, 2),
        "logprob_sum": float(logprobs.double().sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", nargs=3, metavar=("PATH", "PASS", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args)))
        return
    forwarded = [f"--{k}={getattr(args, k)}" for k in ("rows", "prompt", "response", "dtype", "temperature")]
    forwarded.append(f"--threads={args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_large_vocab_model(Path(tmp) / "model", args.prompt + args.response)
        results = []
        for which in PASSES:
            for path in PATHS:
                command = [sys.executable, __file__, "--one", path, which, model_path, *forwarded]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"{args.rows} rows x ({args.prompt} prompt + {args.response} response) tokens, vocabulary {VOCAB}, "
        f"{args.dtype}, temperature {args.temperature}"
    )
    print(f"{'pass':<9} {'path':<7} {'added GB':>9} {'peak GB':>8} {'seconds':>8}")
    for r in results:
        row = f"{r['pass']:<9} {r['path']:<7} {r['added_gb']:>9.2f}"
        print(f"{row} {r['peak_rss_gb']:>8.2f} {r['seconds']:>8.2f}")
    ratios = {}
    for which in PASSES:
        old, logits, new = (next(r for r in results if r["pass"] == which and r["path"] == p) for p in PATHS)
        ratios[which] = round(old["added_gb"] / max(new["added_gb"], 1e-9), 2)
        ratios[f"{which}_logits"] = round(logits["added_gb"] / max(new["added_gb"], 1e-9), 2)
        # The same values either way (bf16 matmuls over different shapes may round differently).
        print(
            f"{which}: before / now = {ratios[which]}x, logits / now = {ratios[which + '_logits']}x memory "
            f"added; logprob (distill: loss) sums {old['logprob_sum']:.1f}, {logits['logprob_sum']:.1f}, "
            f"{new['logprob_sum']:.1f}"
        )
    print(json.dumps({"results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
