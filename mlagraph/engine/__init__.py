"""The runtime around a model: requests, the scheduler, cache pages (with the prefix cache),
batch inputs and the model runner (compiled steps, CUDA graphs), generate / stream / step.

    from mlagraph.engine import Engine
"""

from .block_manager import BlockManager  # noqa: F401
from .engine import Engine, Startup, StepStats  # noqa: F401
from .request import GenerationOutput, Request, SamplingParams, StreamChunk  # noqa: F401
