"""The drafts that ship, as ``typedkv bench``'s real-drafts section times them: each one's K/V geometry, read
from its published config (where each number comes from is beside it), and the features its cache path needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from typedkv.core.tensor_types import CacheFormat, RopeStyle


@dataclass(frozen=True)
class Draft:
    """A draft's K/V geometry and the features its cache path needs.

    MLA drafts (``kv_lora_rank > 0``) write rows of ``kv_lora_rank + rotary_dim`` per token and layer;
    the heads and ``head_dim`` are unused there.
    """

    name: str
    source: str  # where the numbers come from: a config's URL, or a repository and path
    num_layers: int
    hidden: int  # the width the K/V projection reads
    num_kv_heads: int = 1
    head_dim: int = 0
    rotary_dim: int = 0
    rope_theta: float = 10000.0
    rope_style: RopeStyle = "neox"
    rotary_fraction: float = 1.0  # Gemma-4's proportional RoPE: the share of the D/2 frequencies not zero
    k_norm: bool = True
    v_norm: bool = False
    bias: bool = False
    k_eq_v: bool = False  # V is the K projection's output (Gemma-4's attention_k_eq_v)
    per_layer_rope: bool = False  # a cos/sin table per layer, [L, P, R]
    pool: str = "bf16"  # "bf16", or "fp8_scales": FP8 values and the float32 scales the call computes
    kv_lora_rank: int = 0
    cache_format: CacheFormat = "plain"  # MLA pools
    page_size: int = 0  # MLA pools: [L, N, B, row]
    dtype: torch.dtype = torch.bfloat16
    assumed: str = ""  # which numbers are not read from the draft's own config, and why ("" for none)

    @property
    def features(self) -> tuple[str, ...]:
        """The features of `FEATURES` this draft's call needs."""
        wanted = {
            "v_norm": self.v_norm,
            "scale_out": self.pool == "fp8_scales",
            "per_layer_rope": self.per_layer_rope,
            "fp8_ds_mla": self.cache_format == "fp8_ds_mla",
        }
        return tuple(name for name, needed in wanted.items() if needed)

    @property
    def projection_rows(self) -> int:
        """Rows of one layer's K/V projection as the model holds it (K=V: K's rows only)."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.rotary_dim
        return self.num_kv_heads * self.head_dim * (1 if self.k_eq_v else 2)

    def shape(self) -> dict[str, Any]:
        """The numbers a table shows."""
        if self.kv_lora_rank:
            geometry = {"C": self.kv_lora_rank, "R": self.rotary_dim}
        else:
            geometry = {"H": self.num_kv_heads, "D": self.head_dim, "R": self.rotary_dim}
        return {"L": self.num_layers, **geometry, "hidden": self.hidden, "rope_theta": self.rope_theta}

    def shrunk(self, dtype: torch.dtype = torch.float32) -> Draft:
        """The same draft, features and layout at a few layers and narrow heads, for a CPU test.

        An fp8_ds_mla row keeps its fixed ``C = 512, R = 64``.
        """
        layers = min(self.num_layers, 2)
        if self.kv_lora_rank:
            if self.cache_format != "plain":
                return replace(self, num_layers=layers, hidden=32, page_size=4, dtype=torch.bfloat16)
            return replace(self, num_layers=layers, hidden=32, kv_lora_rank=32, rotary_dim=16, page_size=4, dtype=dtype)
        head_dim = min(self.head_dim, 32)
        rotary = max(2, self.rotary_dim * head_dim // self.head_dim // 2 * 2)
        return replace(
            self, num_layers=layers, hidden=32, num_kv_heads=min(self.num_kv_heads, 2), head_dim=head_dim,
            rotary_dim=rotary, dtype=dtype,
        )  # fmt: skip


QWEN3_8B = Draft(
    "Qwen3-8B DFlash",
    "sgl-project/SpecForge configs/qwen3-8b-dflash.json (the layout of z-lab/Qwen3-8B-DFlash-b16)",
    num_layers=5, hidden=4096, num_kv_heads=8, head_dim=128, rotary_dim=128, rope_theta=1e6,
)  # fmt: skip
EAGLE3_LLAMA = Draft(
    "EAGLE-3 Llama-3.1-8B",
    "https://huggingface.co/FasterDFlash/Hanrui/blob/main/progress/github/SpecForge/configs/llama3-8B-eagle3.json"
    " (SpecForge's configs/llama3-8B-eagle3.json); K/V read 2 * hidden_size: sgl-project/sglang"
    " python/sglang/srt/models/llama_eagle3.py",
    num_layers=1, hidden=8192, num_kv_heads=8, head_dim=128, rotary_dim=128, k_norm=False,
    assumed="rope_theta: the config sets none (LlamaConfig's default, 10000); yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's"
    " own config.json was not found",
)  # fmt: skip
GPT_OSS_120B = Draft(
    "gpt-oss-120b DFlash",
    "https://huggingface.co/z-lab/gpt-oss-120b-DFlash (8 layers, hidden 2880, 64/8 heads);"
    " https://huggingface.co/z-lab/gpt-oss-20b-DFlash config.json (head_dim 64, attention_bias, rope_theta 150000)",
    num_layers=8, hidden=2880, num_kv_heads=8, head_dim=64, rotary_dim=64, rope_theta=150000.0, bias=True,
    assumed="head_dim, attention_bias and rope_theta are the 20b draft's (same architecture); the 120b config.json"
    " itself was not found",
)  # fmt: skip
KIMI_K2 = Draft(
    "Kimi-K2 DFlash",
    "https://huggingface.co/z-lab/Kimi-K2.5-DFlash (6 layers, hidden 7168, 64/8 heads, YaRN theta 50000);"
    " sgl-project/SpecForge configs/kimi-k2.7-code-dflash.json (head_dim 128)",
    num_layers=6, hidden=7168, num_kv_heads=8, head_dim=128, rotary_dim=128, rope_theta=50000.0,
)  # fmt: skip
GEMMA4_DSPARK = Draft(
    "Gemma-4 DSpark",
    "deepseek-ai/DeepSpec deepspec/modeling/dspark/gemma4/modeling.py (K=V, no-scale V norm, global heads);"
    " https://huggingface.co/google/gemma-4-12B-it/blob/main/config.json (hidden 3840, 1 global KV head of 512),"
    " the target of https://huggingface.co/deepseek-ai/dspark_gemma4_12b_block7",
    num_layers=5, hidden=3840, num_kv_heads=1, head_dim=512, rotary_dim=512, rope_theta=1e6,
    rotary_fraction=0.25, v_norm=True, k_eq_v=True,
    assumed="the draft's config.json was not found: DeepSpec builds it from the target's text config, 5 draft layers"
    " (DeepSpec config/dflash/dflash_gemma4_12b.py); the full-attention RoPE (theta 1e6, proportional 0.25) is"
    " the Gemma-4 family's",
)  # fmt: skip
DEEPSEEK_MTP = Draft(
    "DeepSeek-V3 MTP",
    "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (num_nextn_predict_layers 1,"
    " kv_lora_rank 512, qk_rope_head_dim 64, hidden 7168)",
    num_layers=1, hidden=7168, rotary_dim=64, rope_style="gptj", kv_lora_rank=512, page_size=64,
)  # fmt: skip
KIMI_K3_DSPARK_MLA = Draft(
    "Kimi-K3 DSpark MLA fp8_ds_mla",
    "sgl-project/SpecForge configs/kimi-k3-dspark-5mla.json (5 MLA layers, kv_lora_rank 512, qk_rope_head_dim 64,"
    " hidden 7168, rope_interleave); rows of 656 bytes: vllm-project/vllm"
    " vllm/v1/attention/backends/mla/flashmla_sparse.py",
    num_layers=5, hidden=7168, rotary_dim=64, rope_style="gptj", kv_lora_rank=512, cache_format="fp8_ds_mla",
    page_size=64,
)  # fmt: skip
DRAFTS = (
    QWEN3_8B,
    replace(QWEN3_8B, name="Qwen3-8B DFlash FP8 scales", pool="fp8_scales"),
    replace(QWEN3_8B, name="Qwen3-8B DFlash per-layer RoPE", per_layer_rope=True),
    EAGLE3_LLAMA,
    GPT_OSS_120B,
    KIMI_K2,
    GEMMA4_DSPARK,
    DEEPSEEK_MTP,
    KIMI_K3_DSPARK_MLA,
)


# The features of typedkv's "drafts as they ship" each draft exercises: a V norm (``v_norm_weight``), scales
# written per row (``k_scale_out``/``v_scale_out``), a RoPE table per layer (``cos_sin_cache`` ``[L, P, R]``),
# DeepSeek's FP8 MLA rows (``cache_format="fp8_ds_mla"``).
FEATURES = ("v_norm", "scale_out", "per_layer_rope", "fp8_ds_mla")
