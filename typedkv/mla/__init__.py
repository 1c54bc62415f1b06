"""The MLA family: ``materialize_mla_kv`` and ``materialize_mla_kv_into_pool`` (api, impl, launch, kernel,
reference)."""
