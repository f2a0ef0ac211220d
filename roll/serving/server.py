"""The endpoint served by uvicorn: in a thread of this process (``ServerThread``, for tests and for a
pipeline that serves its agents), or in the foreground for ``roll serve``."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ServerThread", "serve_model"]

STARTUP_BOUND_S = 60.0  # a liveness bound, not a timing assumption: start-up takes well under a second


class ServerThread:
    """Serves ``app`` on ``host`` at ``port`` (0: a free port, see ``base_url``) from a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="roll-serving", daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_BOUND_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.base_url}")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        """Serve from the calling thread until interrupted (Ctrl-C, SIGTERM)."""
        self._server.run(sockets=[self._socket])

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def serve_model(path: str | Path, host: str, port: int, name: str | None, engine: str = "hf") -> None:
    """``roll serve``: the model at ``path`` (a model directory, or a run's final model or latest
    checkpoint) on the endpoint, in the foreground until interrupted."""
    from roll.export import find_trained

    model_dir = find_trained(path)
    app, served, served_name = build_served(model_dir, name, engine)
    server = ServerThread(app, host, port)
    print(f"serving {model_dir} as {served_name!r} on {server.base_url}/v1 ({engine} engine)", flush=True)
    try:
        server.serve_forever()
    finally:
        served.shutdown()


def build_served(model_dir: Path, name: str | None, engine: str) -> tuple[Any, Any, str]:
    """The endpoint's app over ``model_dir`` served by ``engine`` (``hf``: Hugging Face, on CUDA when
    there is one; ``vllm``: vLLM with the rollout engine's defaults for the device), the engine, and the
    model's name."""
    import torch

    from roll.models.loading import end_of_sequence_ids, load_causal_lm, load_tokenizer
    from roll.serving import require_serving
    from roll.serving.app import Limits, build_app
    from roll.strategies.lora import is_adapter_dir

    require_serving()
    if engine not in ("hf", "vllm"):
        raise ValueError(f"--engine {engine}: choose hf or vllm")
    if is_adapter_dir(model_dir):
        raise ValueError(
            f"{model_dir} is a LoRA adapter; serve the merged model: roll export {model_dir} --merge, then "
            "roll serve the directory it prints"
        )
    tokenizer = load_tokenizer(model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if engine == "vllm":
        served, eos, max_model_len = _vllm_engine(model_dir, tokenizer, device)
    else:
        from roll.strategies.infer.hf import HFEngine

        model = load_causal_lm(model_dir, device=device)
        max_model_len = int(getattr(model.config, "max_position_embeddings", 2048))
        served, eos = HFEngine(model, tokenizer, device), end_of_sequence_ids(tokenizer, model)
    served_name = name or Path(model_dir).resolve().name
    app = build_app(served, tokenizer, served_name, eos, Limits(max_model_len=max_model_len))
    return app, served, served_name


def _vllm_engine(model_dir: Path, tokenizer: Any, device: Any) -> tuple[Any, list[int], int]:
    """vLLM over ``model_dir``: on a CPU its default cache, and a context no longer than that cache holds
    (vLLM refuses to start otherwise); on CUDA the model's whole context."""
    from roll.models.attention_shape import AttentionShape
    from roll.strategies.infer.vllm import CPU_BLOCK_TOKENS, CPU_KV_CACHE_GB, VLLMEngine

    shape = AttentionShape.of_directory(str(model_dir))
    max_model_len = shape.max_positions or 2048
    kv_bytes = None
    if device.type == "cpu":
        kv_bytes = int(CPU_KV_CACHE_GB * (1 << 30))
        held = kv_bytes // shape.kv_bytes_per_token("float32") // CPU_BLOCK_TOKENS * CPU_BLOCK_TOKENS
        max_model_len = min(max_model_len, held)
    served = VLLMEngine(
        str(model_dir),
        tokenizer,
        max_model_len=max_model_len,
        kv_cache_bytes=kv_bytes,
        enforce_eager=device.type != "cuda",
    )
    return served, list(served.end_of_sequence_ids), max_model_len
