"""mmserve: multimodal LLM inference server. Offline API: LLM, SamplingParams, RequestOutput."""

from mmserve.core.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing mmserve stays cheap for the client and the CLI
        from mmserve.llm import LLM

        return LLM
    raise AttributeError(name)
