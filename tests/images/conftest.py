"""Fixtures of the image smoke tests: the built images, or a skip that names why they cannot run here."""

from __future__ import annotations

import pytest

from dmtd.serve.netns import isolate_network
from tests.images.podman import image_missing, image_name, podman_unavailable


def _image(kind: str) -> str:
    reason = podman_unavailable()
    if reason is None:
        reason = image_missing(image_name(kind))
    if reason is not None:
        pytest.skip(reason)
    return image_name(kind)


@pytest.fixture(scope="session")
def operator_image() -> str:
    return _image("operator")


@pytest.fixture(scope="session")
def serving_image() -> str:
    return _image("serving")


@pytest.fixture(scope="session")
def netns() -> None:
    """This process (and what it starts) on a private loopback; list it before redis_server and the like."""
    isolate_network()
