"""DeepSeek V2/V3/V3.2 and V4 over mlagraph ops: config, loading, layers and the step contract
(batch metadata and the forward-method plan). The runtime lives in mlagraph.engine."""

from .batch import Batch, BatchKind, BatchPlan, ForwardMethod, build_batch, choose_forward_method, plan_batch  # noqa: F401
from .config import DeepseekConfig  # noqa: F401
from .config_v4 import DeepseekV4Config  # noqa: F401
from .deepseek import DeepseekForCausalLM  # noqa: F401
from .deepseek_v4 import DeepseekV4ForCausalLM  # noqa: F401


def __getattr__(name: str):
    # `from mlagraph.model import Engine` keeps working; resolved lazily because the engine
    # package imports this one.
    if name in ("Engine", "GenerationOutput"):
        from .. import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
