"""Where the warp-specialised fused projection may run, checked without a GPU.

Its kernel (Gluon, `typedkv._fused_ws_kernel`) runs on the GPU only:
tests/test_gpu_fused_ws.py checks what it computes. Here: the Triton releases it
is taken under.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import triton

from typedkv import _fused_ws


@pytest.fixture
def fresh_available() -> Iterator[None]:
    _fused_ws.available.cache_clear()
    yield
    _fused_ws.available.cache_clear()


@pytest.mark.usefixtures("fresh_available")
@pytest.mark.parametrize(("version", "taken"), [("3.6.0", True), ("3.6.1", True), ("3.9.0", False), ("3.5.1", False)])
def test_available_only_under_the_releases_it_is_written_for(
    monkeypatch: pytest.MonkeyPatch, version: str, taken: bool
) -> None:
    """Gluon's API changes between releases (3.9 has no `async_copy_shared_to_global`): another release keeps the
    fused path's other kernel rather than failing to compile."""
    if _fused_ws.gl is None:
        pytest.skip("no Gluon in this Triton")
    monkeypatch.setattr(triton, "__version__", version)
    assert _fused_ws.available() is taken
