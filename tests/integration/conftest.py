"""Fixtures of the integration tests that run their own control plane."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.operator_cluster import Audited, audited_control_plane


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Audited]:
    """A control plane auditing every write (one per test module)."""
    with audited_control_plane(tmp_path_factory.mktemp("audit")) as a:
        yield a
