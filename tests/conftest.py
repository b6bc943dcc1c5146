"""Shared fixtures: tiny random checkpoints (built once per session) and the gpu marker."""
from __future__ import annotations

import pytest
import torch

from mmserve.testing import make_llava_checkpoint


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> str:
    return str(make_llava_checkpoint(tmp_path_factory.mktemp("tiny_llava"), preset="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_llava_mha_dir(tmp_path_factory) -> str:
    return str(make_llava_checkpoint(tmp_path_factory.mktemp("tiny_llava_mha"), preset="tiny-mha", seed=1))
