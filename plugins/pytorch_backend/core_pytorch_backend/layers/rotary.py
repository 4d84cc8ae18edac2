"""Rotary position embedding: default, linear-scaled, Llama 3 scaled, YaRN and LongRoPE frequencies, and
Qwen2-VL's multimodal rotary embedding (M-RoPE: temporal, height and width positions on sections of the head).

Each is computed as transformers' ``modeling_rope_utils`` computes it (the parity oracle), from the
config's rope settings alone. Two change with the sequence in transformers, which a KV cache written at
other frequencies cannot follow, so each is served over the context where its frequencies stay put
(``context_positions``), and its text is transformers' throughout:

- ``dynamic`` (NTK) has the default frequencies up to ``max_position_embeddings``, where transformers
  starts changing them with the longest sequence.
- ``longrope`` (Phi-3.5, Phi-4-mini, the 128k Phi-3 models) has its short factors up to
  ``original_max_position_embeddings`` (4,096 for those), and its attention factor (from the extended
  context's ratio to that) throughout. Past it transformers switches every position to the long factors at
  once, recomputing the cache then (Phi-3's ``prepare_inputs_for_generation``); a table of short factors
  below that position and long ones above (what a paged cache could hold) matched it only while the
  sequence stayed short and rotated early keys and late queries at different frequencies after (tried on a
  tiny Phi-3: generation diverged at the crossing). So the original context is what is served, unless a
  longer ``max_model_len`` is asked for (``serve_longrope_long``): then every position takes the long
  factors, up to ``max_position_embeddings`` (llama.cpp's rule for a context past the original one), which
  is transformers' text for every sequence whose prompt is longer than the original context, and not for
  shorter ones (transformers keeps the short factors for those)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config, old style (rope_theta + rope_scaling) or transformers 5's
    ``rope_parameters``, merged into one dict with ``rope_type`` and ``rope_theta`` always set."""
    merged: dict[str, Any] = {}
    for attr in ("rope_scaling", "rope_parameters"):
        value = getattr(config, attr, None)
        if isinstance(value, dict):
            merged.update(value)
    merged.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type == "mrope":  # older Qwen2-VL configs: default frequencies, sections split them
        rope_type = "default"
    merged["rope_type"] = rope_type
    if rope_type == "longrope":  # Phi-3's configs keep these beside the rope settings
        merged.setdefault("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
        if not merged["original_max_position_embeddings"]:
            raise NotImplementedError("longrope without original_max_position_embeddings")
        if merged.get("factor") is None:
            extended = getattr(config, "max_position_embeddings", None) or merged["original_max_position_embeddings"]
            merged["factor"] = extended / merged["original_max_position_embeddings"]
    return merged


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(head_dim: int, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies blended between extrapolated (fast) and interpolated (slow, / factor) by a linear
    ramp over the head's dimensions, and the attention factor the cos/sin tables are scaled by."""
    base = float(params["rope_theta"])
    original = params.get("original_max_position_embeddings") or max_positions
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else yarn_mscale(factor))
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


#: set in a LongRoPE config's rope settings by ``serve_longrope_long``: every position takes the long factors
LONG_FACTORS_KEY = "core_long_factors"


def serve_longrope_long(config: Any, max_model_len: int | None) -> bool:
    """Whether ``config``'s LongRoPE is to be served past its original context, as ``max_model_len`` asks;
    if so, marks its rope settings so that every position takes the long factors (module docstring)."""
    params = getattr(config, "rope_parameters", None)
    if not max_model_len or not isinstance(params, dict):
        return False
    merged = rope_parameters(config)
    if merged["rope_type"] != "longrope" or max_model_len <= merged["original_max_position_embeddings"]:
        return False
    params[LONG_FACTORS_KEY] = True
    return True


def longrope_frequencies(head_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """LongRoPE: the default frequencies divided by its short factors (one per frequency; the long ones where
    ``serve_longrope_long`` marked the settings), and the attention factor, ``attention_factor`` or
    sqrt(1 + ln(factor) / ln(original context)), ``factor`` being the extended context's ratio to the original
    one (what rope_parameters fills in from ``max_position_embeddings`` where the config names none, as
    transformers does)."""
    which = "long_factor" if params.get(LONG_FACTORS_KEY) else "short_factor"
    factors = params.get(which)
    if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
        raise NotImplementedError(f"longrope needs {head_dim // 2} {which} values (one per rotary frequency), "
                                  f"got {factors!r}")
    original, factor = params["original_max_position_embeddings"], params["factor"]
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = float(params["rope_theta"])
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**shape), float(attention)


def rope_frequencies(head_dim: int, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of ``params``' rope type and the factor its cos/sin tables are scaled by."""
    rope_type = params["rope_type"]
    if rope_type == "yarn":
        return yarn_frequencies(head_dim, params, max_positions)
    if rope_type == "longrope":
        return longrope_frequencies(head_dim, params)
    return compute_inv_freq(head_dim, params), 1.0


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """The inverse frequencies of the rope types that scale nothing else (default, dynamic, linear, llama3)."""
    rope_type = params["rope_type"]
    inv_freq = default_inv_freq(head_dim, float(params["rope_theta"]))
    if rope_type in ("default", "dynamic"):  # dynamic: the default ones within max_position_embeddings
        return _divided(inv_freq, params.get("rope_freq_factors"))
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, params)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _divided(inv_freq: torch.Tensor, factors: list[float] | None) -> torch.Tensor:
    """``inv_freq`` divided by a GGUF file's per-frequency divisors (``rope_freq_factors``: what llama.cpp's
    converter writes for Llama 3.1's rope scaling, loader.gguf_config), where the file has them."""
    if factors is None:
        return inv_freq
    if len(factors) != inv_freq.shape[0]:
        raise NotImplementedError(f"{len(factors)} rotary frequency divisors for {inv_freq.shape[0]} frequencies")
    return inv_freq / torch.tensor(factors, dtype=inv_freq.dtype)


# A model's rotary tables start with at most this many positions (float32 cos and sin: 128 MiB at 128-wide heads);
# Llama 4's and MiniMax's 10M positions took 17 s and 8 GB to build, for a context the KV cache never holds.
# The loader serves that many unless --max-model-len asks for more (fit_rotary_tables builds them out).
TABLE_ROWS_AT_START = 1 << 18


class RotaryEmbedding(nn.Module):
    """Holds float32 cos/sin tables for every position; ``forward(positions, q, k)`` rotates q and k.

    ``rotary_dim`` below ``head_dim`` (``partial_rotary_factor``: StableLM's 0.25, Phi-4-mini's 0.75)
    rotates each head's first ``rotary_dim`` values, with frequencies of that width, and passes the rest
    through, as transformers does."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any], ops: Any,
                 rotary_dim: int | None = None):
        super().__init__()
        self.ops = ops
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        # where YaRN's factor or original context is missing, context_positions left max_positions at
        # max_position_embeddings: the value transformers falls back on
        self.inv_freq, self.scaling = rope_frequencies(self.rotary_dim, params, max_positions)
        cos, sin = self.tables(min(max_positions, TABLE_ROWS_AT_START))
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def tables(self, rows: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 cos and sin tables [rows, rotary_dim / 2] of positions 0 .. rows - 1."""
        t = torch.arange(rows, dtype=torch.int64, device=device).to(torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:  # YaRN's or LongRoPE's attention factor, applied to the tables as transformers does
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq * D] and k [T, Hkv * D] (or already [T, H, D]); returns them rotated, same shapes."""
        q_shape, k_shape = q.shape, k.shape
        q = q.reshape(q.shape[0], -1, self.head_dim)
        k = k.reshape(k.shape[0], -1, self.head_dim)
        if self.rotary_dim == self.head_dim:
            q, k = self.ops.apply_rotary(q, k, positions, self.cos_cache, self.sin_cache)
        else:
            part = self.rotary_dim
            q_rot, k_rot = self.ops.apply_rotary(q[..., :part].contiguous(), k[..., :part].contiguous(), positions,
                                                 self.cos_cache, self.sin_cache)
            q, k = torch.cat((q_rot, q[..., part:]), dim=-1), torch.cat((k_rot, k[..., part:]), dim=-1)
        return q.reshape(q_shape), k.reshape(k_shape)


def fit_rotary_tables(model: nn.Module, positions: int) -> int:
    """Hold ``positions`` rows in every rotary table of ``model`` (at most its own ``max_positions``): cut where
    it holds more (a server asked for a shorter context than the model's: a 128k model's float32 tables are
    64-384 MiB), built out where it holds fewer (tables start at ``TABLE_ROWS_AT_START`` rows); returns the rows
    they all hold now (``positions`` for a model without rotary tables)."""
    held = positions
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            rows = min(positions, module.max_positions)
            if module.cos_cache.shape[0] > rows:
                module.cos_cache = module.cos_cache[:rows].clone()
                module.sin_cache = module.sin_cache[:rows].clone()
            elif module.cos_cache.shape[0] < rows:
                module.cos_cache, module.sin_cache = module.tables(rows, module.cos_cache.device)
            held = min(held, module.cos_cache.shape[0])
    return held


def rotary_rows(model: nn.Module) -> int | None:
    """The positions every rotary table of ``model`` holds (None: it has none)."""
    rows = [m.cos_cache.shape[0] for m in model.modules() if isinstance(m, RotaryEmbedding)]
    return min(rows) if rows else None


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): ``positions`` is [3, T] (temporal, height, width); frequency slot j of the
    half head takes its angle from the axis whose ``mrope_section`` covers j. [T] positions (text
    only) rotate exactly as plain rotary, since then all three axes are equal."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any], ops: Any,
                 mrope_section: list[int]):
        super().__init__(head_dim, max_positions, params, ops)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must add up to head_dim / 2 = {head_dim // 2}")
        axis = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(mrope_section)])
        self.register_buffer("section_axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        slots = torch.arange(self.section_axis.shape[0], device=positions.device)
        picked = positions[self.section_axis.to(positions.device)].transpose(0, 1)  # [T, D/2]
        cos, sin = self.cos_cache[picked, slots], self.sin_cache[picked, slots]
        q_shape, k_shape = q.shape, k.shape
        q = q.reshape(q.shape[0], -1, self.head_dim)
        k = k.reshape(k.shape[0], -1, self.head_dim)
        rows = torch.arange(q.shape[0], device=positions.device)  # each token has its own table row
        q, k = self.ops.apply_rotary(q, k, rows, cos, sin)
        return q.reshape(q_shape), k.reshape(k_shape)


def context_positions(config: Any) -> int:
    """The positions a decoder config serves: ``max_position_embeddings`` (2048 where it names none), or
    what YaRN extends it to, the original context times the factor (as vLLM derives it: Qwen's long-context
    recipe adds YaRN and keeps max_position_embeddings), or LongRoPE's original context (where its short
    factors hold, see the module's docstring). The rotary tables hold this many positions."""
    base = int(getattr(config, "max_position_embeddings", 0) or 2048)
    params = rope_parameters(config)
    original, factor = params.get("original_max_position_embeddings"), params.get("factor")
    if params["rope_type"] == "yarn" and original and factor:
        return max(base, int(original * factor))
    if params["rope_type"] == "longrope":
        return base if params.get(LONG_FACTORS_KEY) else min(base, int(original))
    return base


def get_rope(config: Any, head_dim: int, ops: Any, partial: bool = False) -> RotaryEmbedding:
    """The rotary embedding an HF decoder config asks for (M-RoPE when it names an mrope_section). ``partial``:
    whether the family turns only ``partial_rotary_factor`` of each head (``whole_head_rotary`` where not)."""
    params = rope_parameters(config)
    max_positions = context_positions(config)
    section = params.get("mrope_section")
    rotary_dim = rotary_dim_of(config, head_dim) if partial else whole_head_rotary(config, head_dim)
    if section:
        if rotary_dim != head_dim:
            raise NotImplementedError("M-RoPE with a partial_rotary_factor is not supported")
        return MRotaryEmbedding(head_dim, max_positions, params, ops, list(section))
    return RotaryEmbedding(head_dim, max_positions, params, ops, rotary_dim)


def whole_head_rotary(config: Any, head_dim: int) -> int:
    """``head_dim``, for the families whose transformers rotary turns whole heads (Llama's and most others'):
    their default frequencies ignore ``partial_rotary_factor``, and their other rope types fail with one below
    1 (cos / sin tables narrower than the heads), so such a config is refused by name."""
    params = rope_parameters(config)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and int(head_dim * float(partial)) != head_dim and params["rope_type"] != "default":
        raise NotImplementedError(f"partial_rotary_factor {partial} with rope_type {params['rope_type']!r} is not "
                                  "supported for this family: its rotary turns whole heads (transformers' fails)")
    return head_dim


def rotary_dim_of(config: Any, head_dim: int) -> int:
    """The values of each head that rotary rotates: ``head_dim * partial_rotary_factor`` (transformers'
    ``rope_parameters`` or the config's own field; 1 where neither sets it)."""
    params = rope_parameters(config)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial in (None, 1, 1.0):
        return head_dim
    rotary_dim = int(head_dim * float(partial))
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise NotImplementedError(f"partial_rotary_factor {partial} gives {rotary_dim} rotated values of a head of "
                                  f"{head_dim}: an even number from 2 to the head's width is supported")
    return rotary_dim

