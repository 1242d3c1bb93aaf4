"""Fixtures of the model tests."""

import pytest

from .helpers import FAMILIES


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param
