"""Static description of a model's cache state: :class:`ModelSpec` and its presets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

__all__ = ["ANCHOR", "ModelSpec", "PlaneSpec", "MODEL_PRESETS"]

#: the pool every request moves (the KV cache); a model's other pools travel with it as
#: pool transfers
ANCHOR = "kv"


@dataclass(frozen=True)
class PlaneSpec:
    """One tensor family of a pool (``k``, ``v``, ``conv``, ``ssm``): per-slot item shape."""

    name: str
    item_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def item_bytes(self) -> int:
        n = 1
        for d in self.item_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ModelSpec:
    """Layers, heads, dtypes and the hybrid parts of a model's cache.

    Layer ids are global. Full-attention layers (neither Mamba nor SWA) use the
    ``kv`` pool, the anchor: one slot per token. Mamba layers keep one state slot
    per checkpoint in the ``mamba`` pool; SWA layers keep the trailing window in
    the ``swa`` pool.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    page_size: int = 16
    mamba_layer_ids: tuple[int, ...] = ()
    mamba_conv_shape: tuple[int, ...] = ()
    mamba_ssm_shape: tuple[int, ...] = ()
    mamba_dtype: torch.dtype = torch.float32
    swa_layer_ids: tuple[int, ...] = ()
    swa_window: int = 0

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ConfigError(f"ModelSpec {self.name!r}: num_layers must be > 0, got {self.num_layers}")
        if self.page_size <= 0:
            raise ConfigError(f"ModelSpec {self.name!r}: page_size must be > 0, got {self.page_size}")
        for attr in ("mamba_layer_ids", "swa_layer_ids"):
            ids = getattr(self, attr)
            bad = [i for i in ids if not 0 <= i < self.num_layers]
            if bad:
                raise ConfigError(f"ModelSpec {self.name!r}: {attr} {bad} outside 0..{self.num_layers - 1}")
        both = set(self.mamba_layer_ids) & set(self.swa_layer_ids)
        if both:
            raise ConfigError(f"ModelSpec {self.name!r}: layers {sorted(both)} are both mamba and swa")
        if self.mamba_layer_ids and not (self.mamba_conv_shape and self.mamba_ssm_shape):
            raise ConfigError(f"ModelSpec {self.name!r}: mamba layers need mamba_conv_shape and mamba_ssm_shape")
        if self.swa_layer_ids and self.swa_window <= 0:
            raise ConfigError(f"ModelSpec {self.name!r}: swa layers need swa_window > 0, got {self.swa_window}")

    # ------------------------------------------------------------ derived
    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        skip = set(self.mamba_layer_ids) | set(self.swa_layer_ids)
        return tuple(i for i in range(self.num_layers) if i not in skip)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.mamba_layer_ids or self.swa_layer_ids)

    @property
    def pool_names(self) -> tuple[str, ...]:
        names = ["kv"]
        if self.mamba_layer_ids:
            names.append("mamba")
        if self.swa_layer_ids:
            names.append("swa")
        return tuple(names)

    def layer_ids(self, pool: str) -> tuple[int, ...]:
        if pool == "kv":
            return self.kv_layer_ids
        if pool == "mamba":
            return self.mamba_layer_ids
        if pool == "swa":
            return self.swa_layer_ids
        from ..errors import UnknownPoolError

        raise UnknownPoolError(f"model {self.name!r} has no pool {pool!r}; pools: {', '.join(self.pool_names)}")

    def planes(self, pool: str) -> tuple[PlaneSpec, ...]:
        if pool in ("kv", "swa"):
            shape = (self.num_kv_heads, self.head_dim)
            return (PlaneSpec("k", shape, self.dtype), PlaneSpec("v", shape, self.dtype))
        if pool == "mamba":
            return (
                PlaneSpec("conv", self.mamba_conv_shape, self.mamba_dtype),
                PlaneSpec("ssm", self.mamba_ssm_shape, self.mamba_dtype),
            )
        self.layer_ids(pool)  # raises UnknownPoolError
        raise AssertionError("unreachable")

    def slot_bytes(self, pool: str) -> int:
        """Bytes one slot of ``pool`` holds across all of its layers."""
        return len(self.layer_ids(pool)) * sum(p.item_bytes for p in self.planes(pool))

    @property
    def kv_size_per_token(self) -> int:
        """MHA bytes per token: ``2 * heads * head_dim * layers * itemsize``."""
        return self.slot_bytes("kv")

    # ------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, page_size: int = 16) -> ModelSpec:
        """Plain MHA: 4 layers, 2 KV heads of 16 (bf16)."""
        return cls(name="tiny", num_layers=4, num_kv_heads=2, head_dim=16, page_size=page_size)

    @classmethod
    def tiny_hybrid(cls, page_size: int = 16) -> ModelSpec:
        """KV + Mamba, 3 Mamba layers to 1 attention layer (Qwen3-Next shape)."""
        return cls(
            name="tiny_hybrid",
            num_layers=8,
            num_kv_heads=2,
            head_dim=16,
            page_size=page_size,
            mamba_layer_ids=(0, 1, 2, 4, 5, 6),
            mamba_conv_shape=(32, 3),
            mamba_ssm_shape=(2, 8, 16),
        )

    @classmethod
    def tiny_swa(cls, page_size: int = 16) -> ModelSpec:
        """KV + sliding-window KV (window 64), SWA and full layers interleaved."""
        return cls(
            name="tiny_swa",
            num_layers=6,
            num_kv_heads=2,
            head_dim=16,
            page_size=page_size,
            swa_layer_ids=(0, 1, 3, 4),
            swa_window=64,
        )

    @classmethod
    def preset(cls, name: str, page_size: int = 16) -> ModelSpec:
        try:
            factory = MODEL_PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown model preset {name!r}; expected one of {', '.join(MODEL_PRESETS)}") from None
        return factory(page_size)  # type: ignore[operator]


MODEL_PRESETS = {
    "tiny": ModelSpec.tiny,
    "tiny_hybrid": ModelSpec.tiny_hybrid,
    "tiny_swa": ModelSpec.tiny_swa,
}
