"""Fixtures of the cluster tests (tests/fixtures/cluster.py)."""

from tests.fixtures.cluster import planted_secrets  # noqa: F401
