"""The command line, the demo and the benchmarks: ``import typedkv`` does not import them."""
