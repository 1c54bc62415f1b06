"""Adapters from inference engines' objects to typedkv calls.

Each engine has its own module (``typedkv.integrations.sglang``). None imports
its engine: they read the engine's objects by their attributes, so importing
an adapter needs only typedkv. They use typedkv's public API alone.
"""
