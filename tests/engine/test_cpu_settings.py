import torch

from rimuru.engine.config import EngineConfig
from rimuru.engine.cpu import choose_threads, cpu_supports_bf16, default_cpu_dtype


def test_threads_follow_request_then_env_then_cores_and_never_exceed_cores():
    assert choose_threads(None, env={}, cores=8) == 8
    assert choose_threads(None, env={"OMP_NUM_THREADS": "3"}, cores=8) == 3
    assert choose_threads(4, env={"OMP_NUM_THREADS": "3"}, cores=8) == 4
    assert choose_threads(16, env={}, cores=8) == 8
    assert choose_threads(None, env={"OMP_NUM_THREADS": "junk"}, cores=2) == 2


def test_cpu_dtype_is_bf16_only_where_the_cpu_has_native_bf16():
    expected = torch.bfloat16 if cpu_supports_bf16() else torch.float32
    assert default_cpu_dtype() == expected
    assert EngineConfig(device="cpu").torch_dtype == expected
    assert EngineConfig(device="cpu", dtype=torch.float32).torch_dtype == torch.float32
