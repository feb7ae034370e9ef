"""Shared test settings."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny shapes: one intra-op thread. With two threads on a loaded 2-core machine, OpenMP barriers in small
    matmuls turn 2 ms into 300 ms. (torch is imported only where it is installed; recipe/ tests need none.)"""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test draws the same random inputs whichever tests ran before it (a test that wants other draws seeds
    its own generator)."""
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(0)


def pytest_collection_modifyitems(items):
    """Multi-process tests (`dist`: spawned ranks and a rendezvous) count as `slow` too (`-m "not slow"`)."""
    for item in items:
        if item.get_closest_marker("dist"):
            item.add_marker(pytest.mark.slow)
