"""Test configuration: debug checking on by default, GPU tests skipped without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import typedkv


@pytest.fixture(autouse=True)
def _debug_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    # As jaxtyping's pytest hook does for its users: the suite runs with full
    # checking unless a test asks for production mode.
    production = request.node.get_closest_marker("production") is not None
    typedkv.set_debug(not production)
    yield
    typedkv.set_debug(False)


@pytest.fixture
def fresh_compile() -> Iterator[None]:
    """torch.compile from scratch (tests/test_compile.py, tests/test_gpu_integration.py).

    Inductor's on-disk caches key compiled code without the inputs' aliasing: code
    compiled for pools that share an allocation (test_shared_allocation_warns)
    would be reused for pools that don't.
    """
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "production: run the test with debug checking off")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
