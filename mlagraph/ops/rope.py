"""Rotary position embedding: the cos/sin table (default RoPE or YaRN) and the ``rope`` op.

The table is built once on the host; the op only gathers rows of it by position, so it has no
host sync and no data-dependent shapes. YaRN reproduces transformers'
``_compute_yarn_parameters`` (including DeepSeek's ``mscale`` / ``mscale_all_dim``) op for op in
float32, so the table is bit-identical to ``DeepseekV3RotaryEmbedding`` on the same device.
"""

import math

import torch

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_choice, check_positive, check_same_dtype, check_tensor, fail
from ._define import custom_op

ROPE_TYPES = ("default", "yarn")


def _rope_type(op: str, scaling: dict | None) -> str:
    if not scaling:
        return "default"
    # transformers 5 says "rope_type"; old configs' rope_scaling says "type".
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    check_choice(op, "scaling['rope_type']", rope_type, ROPE_TYPES)
    return rope_type


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(op: str, scaling: dict, max_position_embeddings: int | None, original: int | None) -> float:
    factor = scaling.get("factor")
    if factor is None:
        # DeepSeek-style configs may leave factor out: transformers then uses the context ratio.
        if max_position_embeddings is None or original is None:
            fail(
                op,
                "max_position_embeddings",
                "an int when scaling has no 'factor' (factor = max_position_embeddings / original)",
                None,
            )
        factor = max_position_embeddings / original
    return factor


def _yarn_original(scaling: dict, max_position_embeddings: int | None) -> int | None:
    # transformers' standardize_rope_params falls back to max_position_embeddings.
    original = scaling.get("original_max_position_embeddings")
    return max_position_embeddings if original is None else original


def _yarn_inv_freq(
    dim: int, base: float, scaling: dict, max_position_embeddings: int | None
) -> tuple[torch.Tensor, float]:
    """inv_freq [dim/2] float32 and the attention factor, exactly as transformers computes them."""
    original = _yarn_original(scaling, max_position_embeddings)
    if original is None:
        fail("rope_cos_sin_cache", "scaling", "'original_max_position_embeddings' or max_position_embeddings", scaling)
    factor = _yarn_factor("rope_cos_sin_cache", scaling, max_position_embeddings, original)

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits num_rotations times into the original context.
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero in the ramp

    # Keep transformers' float32 op order: the table must be bit-identical to its cos/sin.
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _base(base: float, scaling: dict | None) -> float:
    theta = (scaling or {}).get("rope_theta")
    if theta is not None and theta != base:
        fail("rope_cos_sin_cache", "base", f"the scaling dict's rope_theta ({theta})", base)
    return base


def rope_inv_freq(
    rope_dim: int, base: float, scaling: dict | None = None, *, max_position_embeddings: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim/2] float32 on the CPU, attention factor) for default RoPE or YaRN."""
    check_positive("rope_cos_sin_cache", "rope_dim", rope_dim)
    if rope_dim % 2:
        fail("rope_cos_sin_cache", "rope_dim", "an even number", rope_dim)
    check_positive("rope_cos_sin_cache", "base", base)
    base = _base(base, scaling)
    rope_type = _rope_type("rope_cos_sin_cache", scaling)
    partial = (scaling or {}).get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        fail("rope_cos_sin_cache", "scaling['partial_rotary_factor']", "1.0 (pass the rotated dim as rope_dim)", partial)
    if rope_type == "yarn":
        return _yarn_inv_freq(rope_dim, base, scaling, max_position_embeddings)
    return 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)), 1.0


def rope_cos_sin_cache(
    rope_dim: int,
    max_position: int,
    base: float,
    scaling: dict | None = None,
    *,
    max_position_embeddings: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The cos/sin table the ``rope`` op reads: [max_position, rope_dim] float32.

    Row p is ``cat(cos(p·inv_freq)·mscale, sin(p·inv_freq)·mscale)``, each half rope_dim/2 wide,
    with YaRN's attention factor ("mscale") baked in.

    Args:
        rope_dim: rotated dims per head (DeepSeek: qk_rope_head_dim = 64).
        max_position: rows of the table (positions 0..max_position-1).
        base: rope_theta. If ``scaling`` also holds ``rope_theta`` the two must agree.
        scaling: a Hugging Face rope dict (transformers 5 ``rope_parameters`` or an old
            ``rope_scaling``): ``rope_type``/``type`` "default" or "yarn", ``factor``,
            ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
            ``mscale_all_dim``, ``attention_factor``, ``truncate``. ``None`` means default RoPE.
        max_position_embeddings: the config's value; YaRN needs it only when ``factor`` or
            ``original_max_position_embeddings`` is missing (transformers' fallbacks).
        device: where the table lives. inv_freq is computed on the CPU and cos/sin on
            ``device``, as transformers does.
    """
    check_positive("rope_cos_sin_cache", "max_position", max_position)
    inv_freq, attention_factor = rope_inv_freq(
        rope_dim, base, scaling, max_position_embeddings=max_position_embeddings
    )
    inv_freq = inv_freq.to(device)
    pos = torch.arange(max_position, device=device)
    freqs = pos.float()[:, None] * inv_freq
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def yarn_softmax_mscale(scaling: dict | None, *, max_position_embeddings: int | None = None) -> float:
    """The factor DeepSeek multiplies its softmax scale by: mscale(factor, mscale_all_dim)².

    1.0 unless the rope type is "yarn" and ``mscale_all_dim`` is set. DeepSeek-V3 (factor 40,
    mscale_all_dim 1): 192**-0.5 * yarn_softmax_mscale(...) = 0.135234.
    """
    if _rope_type("yarn_softmax_mscale", scaling) != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    original = _yarn_original(scaling, max_position_embeddings)
    factor = _yarn_factor("yarn_softmax_mscale", scaling, max_position_embeddings, original)
    m = _get_mscale(factor, scaling["mscale_all_dim"])
    return m * m


# ---------------------------------------------------------------------------------------------
# the op


def _check_rope(
    op: str, q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    check_tensor(op, "q_pe", q_pe, ndim=3, dtypes=FLOAT_DTYPES)
    t, _, r = q_pe.shape
    if r % 2 != 0:
        fail(op, "q_pe", "an even rope dim (last dim)", f"shape {list(q_pe.shape)}")
    dev = q_pe.device
    check_tensor(op, "k_pe", k_pe, shape=(t, 1, r), device=dev)
    check_same_dtype(op, "k_pe", k_pe, "q_pe", q_pe)
    check_tensor(op, "positions", positions, shape=(t,), dtypes=INDEX_DTYPES, device=dev)
    check_tensor(op, "cos_sin_cache", cos_sin_cache, shape=(None, r), dtypes=(torch.float32,), device=dev)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, H, R] float32, cos/sin [T, 1, R/2] -> rotated [T, H, R] float32 (contiguous)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        # Stack back into pairs so the output keeps the interleaved order the cache stores.
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_reference(
    q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of ``rope`` without the checks; the fused cache op composes it."""
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions.long()][:, None, :]  # [T, 1, R]
    cos, sin = rows[..., :half], rows[..., half:]
    q = _rotate(q_pe.float(), cos, sin, interleaved).to(q_pe.dtype)
    k = _rotate(k_pe.float(), cos, sin, interleaved).to(k_pe.dtype)
    return q, k


@custom_op("mlagraph::rope", mutates_args=())
def rope(
    q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q_pe and k_pe by their tokens' positions.

    Args:
        q_pe: [T, H, R] float32/bf16/fp16.
        k_pe: [T, 1, R], dtype of q_pe (the single shared rope key of MLA).
        positions: [T] int32/int64, each in [0, P).
        cos_sin_cache: [P, R] float32 from :func:`rope_cos_sin_cache`.
        interleaved: True: GPT-J pairs (x[2i], x[2i+1]) rotated by angle i, and the output keeps
            that interleaved order (DeepSeek's main MLA; the cache stores it so). transformers'
            ``apply_rotary_pos_emb_interleave`` instead returns the permutation [evens | odds];
            since q and k get the same permutation, every q·k dot product is the same.
            False: NeoX half split, out = cat(x1·cos − x2·sin, x2·cos + x1·sin) with
            x1 = x[:R/2], x2 = x[R/2:] (the V3.2 indexer).

    Returns:
        (q_rot [T, H, R], k_rot [T, 1, R]) in the input dtype; math in float32.
    """
    _check_rope("rope", q_pe, k_pe, positions, cos_sin_cache)
    return rope_reference(q_pe, k_pe, positions, cos_sin_cache, interleaved)


@rope.register_fake
def rope_fake(q_pe, k_pe, positions, cos_sin_cache, interleaved):
    _check_rope("rope", q_pe, k_pe, positions, cos_sin_cache)
    return q_pe.new_empty(q_pe.shape), k_pe.new_empty(k_pe.shape)
