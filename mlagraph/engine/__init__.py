"""The runtime around a model: requests, the scheduler, cache pages (with the prefix cache),
batch inputs, CUDA-graph capture, generate / step."""

from .block_manager import BlockManager  # noqa: F401
