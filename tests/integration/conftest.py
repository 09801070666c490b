"""Fixtures shared by the integration modules (tests/conftest.py has the Spark sessions)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def equivalence_frame(spark):
    """The equivalence dataset as a DataFrame: ``features`` array<float>, ``label`` long."""
    from tests.integration import equivalence_jobs as jobs

    x, y = jobs.dataset()
    rows = [(a.tolist(), int(b)) for a, b in zip(x, y)]
    return spark.createDataFrame(rows, "features array<float>, label long")
