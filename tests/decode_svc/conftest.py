import pytest

from decode_one import ARGS
from engine import EngineArgs, LLMEngine


@pytest.fixture(scope="module")
def engine():
    """A decode engine (random:tiny on the CPU, 64 blocks of 16 tokens), shared by a module's tests. No prefix
    caching: the tests' prompts repeat one token, and a later test would reuse an earlier one's blocks instead of
    receiving its own (the reuse has its own test, test_a_reused_prefix_is_not_written)."""
    return LLMEngine.from_engine_args(EngineArgs(**ARGS, enable_prefix_caching=False))
