"""DeepSeek V2/V3/V3.2 and V4 over mlagraph ops, and a small engine around it."""

from .batch import Batch, BatchKind, BatchPlan, ForwardMethod, build_batch, choose_forward_method, plan_batch  # noqa: F401
from .config import DeepseekConfig  # noqa: F401
from .config_v4 import DeepseekV4Config  # noqa: F401
from .deepseek import DeepseekForCausalLM  # noqa: F401
from .deepseek_v4 import DeepseekV4ForCausalLM  # noqa: F401
from .engine import Engine, GenerationOutput  # noqa: F401
