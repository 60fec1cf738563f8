"""mlagraph: DeepSeek Multi-head Latent Attention that compiles cleanly and runs fast.

    import mlagraph
    from mlagraph.model import DeepseekForCausalLM, Engine
    compiled = mlagraph.compile(model)        # torch.compile + mlagraph's passes

See README.md for the tour.
"""

from . import ops  # noqa: F401  (registers torch.ops.mlagraph.*)
from . import passes  # noqa: F401
from .compiler import compile  # noqa: F401,A001

__version__ = "0.1.0"
