"""Peak memory of generation with a real-sized vocabulary (151,936 tokens, Qwen2's).

Each path runs in its own process, so each peak RSS is that path's alone:

- ``all_logits``: the old ``hf_generate`` (before issue 16): ``generate(output_logits=True)`` and the
  logits of every step stacked into [B, T, V] on the CPU to take the sampled tokens' logprobs.
- ``hf_generate``: today's ``roll.strategies.hf_generate`` (logprobs recorded step by step).
- ``engine``: ``HFEngine``, the continuous-batching engine the rollout workers run.

    python benchmarks/generation_memory.py                       # compare all three, 64 x 128 tokens
    python benchmarks/generation_memory.py --path engine --tokens 512 --save out.pt   # one path

The model is a random one-layer Qwen2 (hidden 64) built and saved here, then loaded through
``roll.models.loading``. EOS is an id outside the vocabulary, so every row runs to ``--tokens``: what is
measured is memory at a known length. The last line printed is JSON (the test reads it).
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

VOCAB = 151_936
PATHS = ("all_logits", "hf_generate", "engine")


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


class _Tokenizer:
    """What the engine needs from a tokenizer: the stop and pad ids, and decoding (unused here)."""

    eos_token_id = VOCAB  # never sampled: see the module docstring
    pad_token_id = 1

    def batch_decode(self, ids, skip_special_tokens: bool = True) -> list[str]:
        return [""] * len(ids)


SMALL_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
)


def build_large_vocab_model(directory: Path, max_positions: int = 1024, **shape: int) -> str:
    """A random Qwen2 with the 151,936-token vocabulary and tied embeddings, saved at ``directory``. By
    default one layer of hidden 64 (``SMALL_SHAPE``), so the logits dominate its memory (``train_memory.py``
    builds the same one); ``shape`` overrides its config fields."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        **{**SMALL_SHAPE, **shape},
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return str(directory)


def _all_logits_generate(model, batch, params, eos_id: int, pad_id: int):
    """The pre-issue-16 implementation, kept here only to measure it."""
    import torch
    from transformers import GenerationConfig

    from roll.algorithms.functional import logprobs_from_logits

    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=True,
        top_k=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = model.generate(
        input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], generation_config=config
    )
    new_tokens = out.sequences[:, batch["prompt_ids"].shape[1] :]
    logits = torch.stack(out.logits, dim=1).float()
    return new_tokens, logprobs_from_logits(logits, new_tokens)


def run_one(path: str, rows: int, tokens: int, save: str | None) -> dict:
    import torch

    from roll.data.batch import Batch
    from roll.models.loading import load_causal_lm
    from roll.strategies import hf_generate
    from roll.strategies.infer.hf import HFEngine
    from roll.strategies.requests import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save and str(Path(save).with_suffix(".model")) or str(Path(tmp) / "model")
        build_large_vocab_model(Path(model_dir))
        model = load_causal_lm(model_dir)
        generator = torch.Generator().manual_seed(1)
        prompt_ids = torch.randint(2, VOCAB, (rows, 16), generator=generator)
        batch = Batch(tensors={"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids)})
        params = SamplingParams(max_new_tokens=tokens)
        before = _rss_gb()
        torch.manual_seed(2)
        start = time.perf_counter()
        if path == "all_logits":
            with torch.no_grad():
                response_ids, logprobs = _all_logits_generate(model, batch, params, VOCAB, 1)
            mask = torch.ones_like(response_ids)
        elif path == "hf_generate":
            out = hf_generate.generate(model, batch, params, VOCAB, 1)
            response_ids, mask, logprobs = out["response_ids"], out["response_mask"], out["rollout_logprobs"]
        else:
            engine = HFEngine(model, _Tokenizer(), "cpu")
            try:
                out = engine.generate(batch, params)
            finally:
                engine.shutdown()
            response_ids, mask, logprobs = out["response_ids"], out["response_mask"], out["rollout_logprobs"]
        seconds = time.perf_counter() - start
        if save:
            torch.save(
                {
                    "model_path": model_dir,
                    "prompt_ids": prompt_ids,
                    "prompt_mask": torch.ones_like(prompt_ids),
                    "response_ids": response_ids,
                    "response_mask": mask,
                    "rollout_logprobs": logprobs,
                },
                save,
            )
    return {
        "path": path,
        "rows": rows,
        "tokens": tokens,
        "generated_tokens": int(mask.sum()),
        "rss_before_gb": round(before, 3),
        "peak_rss_gb": round(_rss_gb(), 3),
        "seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", choices=PATHS, help="run one path in this process (default: compare all)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--save", help="with --path: save the outputs (and the model next to them)")
    args = parser.parse_args()
    if args.path:
        print(json.dumps(run_one(args.path, args.rows, args.tokens, args.save)))
        return
    print(f"vocabulary {VOCAB}, {args.rows} rows x {args.tokens} new tokens, one process per path")
    print(f"{'path':<12} {'peak RSS GB':>12} {'before gen GB':>14} {'seconds':>8}")
    for path in PATHS:
        cmd = [
            sys.executable,
            __file__,
            "--path",
            path,
            "--rows",
            str(args.rows),
            "--tokens",
            str(args.tokens),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{path:<12} failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{path:<12} {r['peak_rss_gb']:>12.2f} {r['rss_before_gb']:>14.2f} {r['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
