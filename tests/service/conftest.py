"""Fixtures of the service modules that serve the real default model over both APIs."""
import openai
import pytest

from splitserve.engine.model_loader import DEFAULT_MODEL, load_tokenizer, resolve_model
from tests.harness.stack import start_stack


@pytest.fixture(scope="module")
def smollm2_stack(tmp_path_factory):
    """Redis, a gateway (gRPC and the OpenAI HTTP API), a prefill and a decode worker serving the
    real default model in fp32; one per module that asks for it."""
    running = start_stack(DEFAULT_MODEL, tmp_path_factory, prefill=1, decode=1, http=True)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def openai_client(smollm2_stack):
    """The real ``openai`` SDK on that stack's HTTP API (no retries: a test sees every answer)."""
    with openai.OpenAI(base_url=smollm2_stack.http + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer (a module may define its own ``tokenizer``)."""
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def reference(hf_reference):
    """transformers' greedy output of the default model (fp32), the oracle of these modules (a module
    may define its own ``reference``)."""
    return hf_reference(resolve_model(DEFAULT_MODEL))
