import pytest
from tiny import tiny_trio


@pytest.fixture(scope="session")
def llama_trio():
    return tiny_trio("llama")


@pytest.fixture(scope="session")
def qwen_trio():
    return tiny_trio("qwen2", seed=10)
