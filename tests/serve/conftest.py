import pytest

from rimuru.serve.server import build_app
from tests.serve.fake_engine import FakeLLM
from tests.serve.harness import running_server


@pytest.fixture
def fake_engine():
    return FakeLLM(max_model_len=512, step_delay_s=0.002)


@pytest.fixture
def server(fake_engine):
    with running_server(build_app(fake_engine)) as url:
        yield url
