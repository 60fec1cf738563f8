"""DeepSeek's multi-token-prediction (MTP) layer: the draft model of speculative decoding.

DeepSeek-V3 / V3.2 checkpoints carry one such layer (``num_nextn_predict_layers: 1``) under
``model.layers.{num_hidden_layers}.*``. At position p it reads the main model's final hidden
state h_p (after the final norm, the state the main model's logits come from) and the
embedding of the token that follows, t_{p+1}, and predicts t_{p+2}:

    x = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p)))       # [T, 2D] -> [T, D]
    y = decoder_layer(x)                                          # attention over its own cache
    logits = lm_head(shared_head.norm(y))

The concat order (embedding first) is the one of DeepSeek's checkpoints as SGLang and vLLM
load them. The embedding and the output head are the main model's: the checkpoint stores
copies of them in the layer (``embed_tokens``, ``shared_head.head``), which the loader skips.
Chained drafts (k > 1) feed the layer's own output state ``shared_head.norm(y)`` back as the
next position's h, the way the main model's normed state is fed the first time.

Its decoder layer is an ordinary one with layer index ``num_hidden_layers``: its attention
reads and writes ``caches.latent[num_hidden_layers]`` (and the indexer's keys for V3.2), a
cache of its own over the same page ids as the main model's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import backends
from .attention import KVCaches, RMSNorm
from .batch import Batch
from .config import DeepseekConfig
from .deepseek import DecoderLayer


class MTPLayer(DecoderLayer):
    """The MTP layer; parameter names are the checkpoint's after ``model.layers.{n}.`` (the
    decoder layer's ``self_attn.*``, ``mlp.*``, norms, and ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm``)."""

    def __init__(self, cfg: DeepseekConfig, backend: backends.Backend):
        super().__init__(cfg, cfg.num_hidden_layers, backend)
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, cfg.rms_norm_eps)


def mtp_step(model, batch: Batch, caches: KVCaches, hidden: torch.Tensor) -> torch.Tensor:
    """One MTP step over ``batch``: its tokens t_{p+1} [T] at positions p, with the main
    model's hidden states h_p [T, D] of those positions; writes the MTP layer's cache (index
    ``num_hidden_layers`` of ``caches``).

    Returns the layer's normed output [N, D] at ``batch.logits_indices`` [N]:
    ``model.logits(out)`` predicts t_{p+2}, and ``out`` is the h of a chained next draft.
    (The caller takes logits only at the rows it drafts from: one per request.)
    """
    mtp = model.mtp
    e = mtp.enorm(model.model.embed_tokens(batch.input_ids))
    x = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden)], dim=-1))
    y = mtp(x, batch, model.rope_cos_sin, caches)
    return mtp.shared_head.norm(y[batch.logits_indices])


def target_step(model, batch: Batch, caches: KVCaches) -> tuple[torch.Tensor, torch.Tensor]:
    """The main model's step with its hidden states: float32 logits [N, V] and the normed
    final hidden states [N, D] at ``batch.logits_indices`` (what the MTP layer reads)."""
    return model.target_head(model.layers_out(batch, caches), batch.logits_indices)
