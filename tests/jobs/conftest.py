import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The built-in byte-level DeepSeek tokenizer (the one smoke runs use)."""
    from dsv4.tokenizer import Tokenizer

    return Tokenizer()
