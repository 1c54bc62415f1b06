"""A small typed draft model whose K/V path is one `typedkv.KVMaterializer`.

The draft reads the target model's hidden states for the context tokens, as
EAGLE-style drafters do: every draft layer attends over K/V projected from those
same hidden states, so the K/V of all layers is one GEMM and one fused launch.
The layers are Qwen3-style attention: grouped-query heads, per-head RMSNorm on Q
and K (``q_norm``, ``k_norm``) before NeoX RoPE, K/V projection rows K then V.

``main`` runs the draft twice, with K/V from the layers' own unfused modules and
from the materializer, and checks that the two agree::

    python examples/draft_model.py                  # CPU, float32
    python examples/draft_model.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

import typedkv


@dataclass(frozen=True)
class DraftConfig:
    """The draft's sizes (a tiny one: the example runs in CI, also under Triton's interpreter)."""

    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    max_positions: int = 256


def rope_cos_sin(max_positions: int, rotary_dim: int, theta: float) -> Float[Tensor, "P R"]:
    """Row ``p`` holds ``cos`` then ``sin`` of the ``R/2`` rotary angles at position ``p`` (typedkv's layout)."""
    inv_freq = theta ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def apply_rope(
    x: Float[Tensor, "T heads D"], positions: Int[Tensor, " T"], cos_sin_cache: Float[Tensor, "P R"]
) -> Float[Tensor, "T heads D"]:
    """NeoX RoPE (rotate halves) on the first R dims, in float32, rounded once to x's dtype."""
    cos, sin = cos_sin_cache[positions].float()[:, None, :].chunk(2, dim=-1)
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, in float32, rounded to the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Float[Tensor, "*batch D"]) -> Float[Tensor, "*batch D"]:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class DraftLayer(nn.Module):
    """One Qwen3-style attention layer over the context's K/V."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * kv_heads * head_dim, bias=False)  # K rows, then V rows
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, config.rms_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_eps)

    def unfused_kv(
        self, context: Float[Tensor, "T hidden"], positions: Int[Tensor, " T"], cos_sin_cache: Float[Tensor, "P R"]
    ) -> tuple[Float[Tensor, "T H D"], Float[Tensor, "T H D"]]:
        """This layer's K (k_norm, then RoPE) and V, module by module."""
        k, v = self.kv_proj(context).unflatten(-1, (2, self.config.num_kv_heads, self.config.head_dim)).unbind(1)
        return apply_rope(self.k_norm(k), positions, cos_sin_cache), v

    def forward(
        self,
        x: Float[Tensor, "N hidden"],
        query_positions: Int[Tensor, " N"],
        k: Float[Tensor, "T H D"],
        v: Float[Tensor, "T H D"],
        cos_sin_cache: Float[Tensor, "P R"],
    ) -> Float[Tensor, "N hidden"]:
        """The draft tokens ``x`` attend over the context's K/V; residual added."""
        config = self.config
        q = self.q_proj(x).unflatten(-1, (config.num_heads, config.head_dim))
        q = apply_rope(self.q_norm(q), query_positions, cos_sin_cache)
        group = config.num_heads // config.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attended = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        out: Tensor = x + self.o_proj(attended.transpose(0, 1).flatten(1))
        return out


class DraftModel(nn.Module):
    """A stack of draft layers over one context; K/V of every layer from the same context hidden states."""

    cos_sin_cache: Tensor

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.register_buffer("cos_sin_cache", rope_cos_sin(config.max_positions, config.head_dim, config.rope_theta))

    def draft_layers(self) -> list[DraftLayer]:
        return [layer for layer in self.layers if isinstance(layer, DraftLayer)]

    def unfused_kv(
        self, context: Float[Tensor, "T hidden"], positions: Int[Tensor, " T"]
    ) -> tuple[Float[Tensor, "L T H D"], Float[Tensor, "L T H D"]]:
        """Every layer's K/V, layer by layer and module by module (the path typedkv replaces)."""
        per_layer = [layer.unfused_kv(context, positions, self.cos_sin_cache) for layer in self.draft_layers()]
        return torch.stack([k for k, _ in per_layer]), torch.stack([v for _, v in per_layer])

    def materializer(self) -> typedkv.KVMaterializer:
        """The K/V path of all layers as one object, built once from the layers' own weights."""
        layers = self.draft_layers()
        return typedkv.KVMaterializer(
            [layer.kv_proj.weight for layer in layers],
            [layer.k_norm.weight for layer in layers],
            self.config.rms_eps,
            self.cos_sin_cache,
            num_kv_heads=self.config.num_kv_heads,
            rope_style="neox",
        )

    def forward(
        self,
        x: Float[Tensor, "N hidden"],
        query_positions: Int[Tensor, " N"],
        k: Float[Tensor, "L T H D"],
        v: Float[Tensor, "L T H D"],
    ) -> Float[Tensor, "N hidden"]:
        for i, layer in enumerate(self.draft_layers()):
            x = layer(x, query_positions, k[i], v[i], self.cos_sin_cache)
        return x


@dataclass(frozen=True)
class Agreement:
    """Largest absolute differences between the fused and the unfused draft."""

    k: float
    v: float
    output: float


def compare(
    config: DraftConfig, device: torch.device, dtype: torch.dtype, num_context: int = 12, num_draft: int = 4
) -> Agreement:
    """Run the draft with unfused and with materialized K/V; raise if they disagree beyond rounding."""
    torch.manual_seed(0)
    model = DraftModel(config).to(device=device, dtype=dtype).eval()
    for layer in model.draft_layers():  # non-trivial norm weights
        for norm in (layer.q_norm, layer.k_norm):
            nn.init.uniform_(norm.weight, 0.5, 1.5)
    materializer = model.materializer()
    with torch.inference_mode():
        context = torch.randn(num_context, config.hidden_size, device=device, dtype=dtype)
        positions = torch.arange(num_context, device=device)
        x = torch.randn(num_draft, config.hidden_size, device=device, dtype=dtype)
        query_positions = torch.arange(num_context, num_context + num_draft, device=device)

        k_ref, v_ref = model.unfused_kv(context, positions)
        k, v = materializer(context, positions)
        out_ref = model(x, query_positions, k_ref, v_ref)
        out = model(x, query_positions, k, v)
    # The fused GEMM covers all layers at once, so its sums may round apart from
    # the per-layer ones: the two agree to the dtype's rounding, not bit for bit.
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(out, out_ref)
    return Agreement(*(float((a.float() - b.float()).abs().max()) for a, b in ((k, k_ref), (v, v_ref), (out, out_ref))))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    config = DraftConfig()
    agreement = compare(config, torch.device(args.device), getattr(torch, args.dtype))
    print(
        f"draft model, {config.num_layers} layers, {args.dtype} on {args.device}: fused and unfused agree "
        f"(max |diff| K {agreement.k:.3g}, V {agreement.v:.3g}, output {agreement.output:.3g})"
    )


if __name__ == "__main__":
    main()
