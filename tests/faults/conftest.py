"""Fixtures every fault test module shares; each module brings its own ``stack``."""
import pytest


@pytest.fixture(scope="module")
def reference(llama_reference):
    return llama_reference


@pytest.fixture
def baseline(stack):
    """Free KV pages per worker before the test: afterwards every page must be back."""
    return stack.free_pages()
