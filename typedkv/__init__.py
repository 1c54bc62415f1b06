"""typedkv: fused, typed KV materialization for draft models and inference engines.

The public surface is exactly what this module re-exports.
"""

from typedkv.core.config import debug_enabled, set_debug
from typedkv.core.errors import InputError
from typedkv.core.tensor_types import (
    CacheFormat,
    Index,
    KVLayout,
    KVPoolDtype,
    ParamFloat,
    PoolFloat,
    RopeStyle,
    StorageFloat,
)
from typedkv.kv.api import materialize_kv, materialize_kv_into_pool
from typedkv.mla.api import materialize_mla_kv, materialize_mla_kv_into_pool
from typedkv.projection.materializer import KVMaterializer
from typedkv.projection.mla_materializer import MLAKVMaterializer
from typedkv.rope import cos_sin_cache, cos_sin_cache_from_hf

__version__ = "0.1.0"

__all__ = [
    "CacheFormat",
    "Index",
    "InputError",
    "KVLayout",
    "KVMaterializer",
    "KVPoolDtype",
    "MLAKVMaterializer",
    "ParamFloat",
    "PoolFloat",
    "RopeStyle",
    "StorageFloat",
    "cos_sin_cache",
    "cos_sin_cache_from_hf",
    "debug_enabled",
    "materialize_kv",
    "materialize_kv_into_pool",
    "materialize_mla_kv",
    "materialize_mla_kv_into_pool",
    "set_debug",
]
