"""The materializers (``KVMaterializer``, ``MLAKVMaterializer``): the projection GEMM, fused with the K/V
epilogue where that is faster; its kernels, launch and tuning tables."""
