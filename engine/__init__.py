"""A continuous-batching LLM engine: paged KV cache, prefix caching, chunked prefill.

Public API (vLLM-shaped): `LLM`, `SamplingParams`, `AsyncEngine`, `EngineConfig`.
Names are imported lazily so that the plain-Python parts (scheduler, block pool) can be
used and tested without importing torch.
"""
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
