"""Rotary position embedding as Qwen2/Qwen3 apply it (neox style, ``rotate_half``).

The first ``rotary_dim = head_dim * partial_rotary_factor`` dims of each head are rotated, as
pairs ``(i, i + rotary_dim/2)``; the rest pass through (Qwen3-Next / Qwen3.5 use a factor of 0.25).
cos/sin are cached in fp32 for positions ``[0, max_position)`` and indexed by a positions tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rimuru.models.spec import ModelSpec


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin cache ``[max_position, rotary_dim]`` (fp32) and ``forward(positions, q, k)``.

    Only the default RoPE type (no YaRN/linear/dynamic scaling) is implemented.
    """

    def __init__(self, head_dim: int, rope_theta: float, max_position: int, partial_rotary_factor: float = 1.0,
                 device: str | torch.device | None = None) -> None:
        super().__init__()
        rotary_dim = int(head_dim * partial_rotary_factor)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary dim {rotary_dim} (head_dim {head_dim} * {partial_rotary_factor}) must be even")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.rope_theta = float(rope_theta)
        self.max_position = max_position
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device)
                                               / rotary_dim))  # [rotary_dim/2]
        freqs = torch.arange(max_position, device=device).float()[:, None] * inv_freq  # [P, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rotary_dim]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    @classmethod
    def from_spec(cls, spec: ModelSpec, device: str | torch.device | None = None) -> RotaryEmbedding:
        """head_dim, rope theta, partial rotary factor and max positions of a model."""
        if spec.rope_type != "default":
            raise NotImplementedError(f"RoPE type {spec.rope_type!r} is not implemented (only 'default')")
        return cls(spec.head_dim, spec.rope_theta, spec.max_position_embeddings, spec.partial_rotary_factor,
                   device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, rotary_dim]`` (fp32) at ``positions [T]``."""
        positions = positions.long()
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` at ``positions [T]``; fp32 math, result in the input dtype."""
        return self.apply(q, k, self.cos_sin(positions))

    def apply(self, q: torch.Tensor, k: torch.Tensor,
              cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate with ``cos_sin`` from :meth:`cos_sin` (gathered once per step, shared by every layer)."""
        cos, sin = cos_sin
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, rotary_dim]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = x[..., : self.rotary_dim].float()
        rot = rot * cos + rotate_half(rot) * sin
        if self.rotary_dim == self.head_dim:
            return rot.to(x.dtype)
        return torch.cat((rot.to(x.dtype), x[..., self.rotary_dim:]), dim=-1)
