"""jspec: speculative-decoding LLM inference in JAX with Pallas kernels."""

from jspec.engine.llm_engine import EngineConfig, LLMEngine
from jspec.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jspec.inputs import TextPrompt, TokensPrompt
from jspec.llm import LLM, generate
from jspec.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "generate", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "LLMEngine", "EngineConfig", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"
