"""typedkv: fused, typed KV materialization for draft models and inference engines.

The public surface is exactly what this module re-exports.
"""

from ._api import materialize_kv as materialize_kv
from ._api import materialize_kv_into_pool as materialize_kv_into_pool
from ._config import debug_enabled as debug_enabled
from ._config import set_debug as set_debug
from ._errors import InputError as InputError
from ._materializer import KVMaterializer as KVMaterializer
from ._mla import materialize_mla_kv as materialize_mla_kv
from ._mla import materialize_mla_kv_into_pool as materialize_mla_kv_into_pool
from ._mla_materializer import MLAKVMaterializer as MLAKVMaterializer
from ._rope_tables import cos_sin_cache as cos_sin_cache
from ._rope_tables import cos_sin_cache_from_hf as cos_sin_cache_from_hf
from ._types import Index as Index
from ._types import KVLayout as KVLayout
from ._types import ParamFloat as ParamFloat
from ._types import PoolFloat as PoolFloat
from ._types import RopeStyle as RopeStyle
from ._types import StorageFloat as StorageFloat

__version__ = "0.1.0"

__all__ = [
    "Index",
    "InputError",
    "KVLayout",
    "KVMaterializer",
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
