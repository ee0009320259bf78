"""Fixtures for the training tests: one tiny model directory and corpus per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.helpers import save_tiny, tiny_corpus


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_corpus_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("corpus") / "c"
    tiny_corpus(tiny_dir, out)
    torch.set_num_threads(n)
    return out


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning threads crawl on a loaded machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
