"""jspec: speculative-decoding LLM inference in JAX with Pallas kernels."""

from jspec.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from jspec.llm import LLM, generate
from jspec.sampling_params import SamplingParams

__all__ = ["LLM", "generate", "SamplingParams", "RequestOutput", "LLMEngine", "EngineConfig"]
__version__ = "0.1.0"
