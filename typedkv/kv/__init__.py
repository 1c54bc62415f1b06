"""The K/V family: ``materialize_kv`` and ``materialize_kv_into_pool`` (api, impl, launch, kernel, reference)."""
