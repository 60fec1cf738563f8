"""mlagraph: DeepSeek Multi-head Latent Attention that compiles cleanly and runs fast.

    import mlagraph
    from mlagraph.model import DeepseekForCausalLM, Engine

See README.md for the tour.
"""

from . import ops  # noqa: F401  (registers torch.ops.mlagraph.*)

__version__ = "0.1.0"
