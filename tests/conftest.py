"""Shared fixtures: every engine and model is built once per session, as the suite runs on a few
shared CPU cores."""
import os

import pytest
import torch

# Triton kernels run in its interpreter; this must precede any import of triton, and importing
# building a model on CUDA imports it (nanovllm/kernels/)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import build_random_checkpoint, make_llm  # noqa: E402

# small models run faster on one thread than on cores shared with other work (OpenMP spin-waits)
torch.set_num_threads(int(os.environ.get("NANOVLLM_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip without CUDA."""
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory):
    """random_checkpoint(name) -> (model dir, HF model) of tests.helpers.RANDOM_MODELS[name],
    built once."""
    built = {}

    def get(name: str):
        if name not in built:
            path = str(tmp_path_factory.mktemp(name))
            built[name] = (path, build_random_checkpoint(name, path))
        return built[name]
    return get


@pytest.fixture(scope="session")
def tiny_path(random_checkpoint) -> str:
    """The random Qwen3 checkpoint, for engine behavior that does not need real weights."""
    return random_checkpoint("qwen3")[0]


@pytest.fixture(scope="session")
def random_smol(tmp_path_factory) -> str:
    """A random 2-layer model with SmolLM2's vocabulary, for the servers' tests (serve_helpers)."""
    from tests.serve_helpers import build_random_smol
    return build_random_smol(str(tmp_path_factory.mktemp("random_smol")))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from nanovllm.utils.fetch import smollm2_path
    return smollm2_path()


@pytest.fixture(scope="session")
def smol_llm(smollm2_dir):
    """One SmolLM2 engine for the whole session (every test leaves it with nothing queued)."""
    return make_llm(smollm2_dir, max_model_len=1024, num_kvcache_blocks=512)
