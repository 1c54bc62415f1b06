"""What every kernel family shares: errors, configuration, annotations and their checking, messages,
memory-overlap checks, torch op registration, the kernel launcher and the jit pieces of the kernels."""
