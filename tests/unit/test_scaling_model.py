"""The alpha-beta model behind ``python -m hvd_spark.bench scaling``."""

from __future__ import annotations

import pytest

from hvd_spark.bench.scaling import RESNET50_BYTES, LinkModel, efficiency


def test_ring_times_follow_the_link_and_the_steps():
    link = LinkModel(alpha=10e-6, bandwidth=125e6)  # 1 Gbit/s
    nbytes = 64 << 20
    # Two hosts, one rank each: two steps and the buffer once over the link.
    assert link.flat(nbytes, 2, 1) == pytest.approx(2 * 10e-6 + nbytes / 125e6)
    # 2x2: the flat ring sends 1.5x the buffer over a host's link, hierarchical 1x.
    flat, hier = link.flat(nbytes, 2, 2), link.hierarchical(nbytes, 2, 2, local_bw=1e12)
    assert flat / hier == pytest.approx(1.5, rel=1e-3)
    # Many hosts: the flat ring pays 2(N-1) steps, hierarchical 2(H-1).
    assert link.flat(1024, 512, 4) - link.hierarchical(1024, 512, 4, 1e12) == pytest.approx(
        2 * (2048 - 512) * 10e-6, rel=1e-3)


def test_efficiency_bounds():
    assert efficiency(0.2, 0.05) == (pytest.approx(0.8), 1.0)
    no_overlap, full = efficiency(0.2, 0.4)
    assert no_overlap == pytest.approx(1 / 3) and full == pytest.approx(0.5)
    assert RESNET50_BYTES == 102_228_128
