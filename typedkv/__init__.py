"""typedkv: fused, typed KV materialization for draft models and inference engines.

The public surface is exactly what this module re-exports.
"""

from ._config import debug_enabled as debug_enabled
from ._config import set_debug as set_debug
from ._errors import InputError as InputError
from ._materializer import KVMaterializer as KVMaterializer
from ._mla import materialize_mla_kv as materialize_mla_kv
from ._mla import materialize_mla_kv_into_pool as materialize_mla_kv_into_pool
from ._mla_materializer import MLAKVMaterializer as MLAKVMaterializer
from ._ops import materialize_kv as materialize_kv
from ._ops import materialize_kv_into_pool as materialize_kv_into_pool
from ._types import KVLayout as KVLayout
from ._types import RopeStyle as RopeStyle

__version__ = "0.1.0"

__all__ = [
    "InputError",
    "KVLayout",
    "KVMaterializer",
    "MLAKVMaterializer",
    "RopeStyle",
    "debug_enabled",
    "materialize_kv",
    "materialize_kv_into_pool",
    "materialize_mla_kv",
    "materialize_mla_kv_into_pool",
    "set_debug",
]
