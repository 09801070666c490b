"""The several-host allreduce benchmark's Open MPI peer: mpirun on namespace hosts, its
daemons started through the namespace agent, TCP between hosts."""

from __future__ import annotations

from hvd_spark.bench.multihost_allreduce import format_table, mpi_across


def test_open_mpi_runs_across_namespace_hosts_and_joins_the_table(bare_hosts):
    net = bare_hosts(2)
    rows, described = mpi_across(net, 1, [4096, 1 << 16], budget=2e6)
    assert described.startswith("mpirun (Open MPI)"), described
    assert [r["bytes"] for r in rows] == [4096, 1 << 16]
    assert all(0 < r["mpi"] < 1.0 for r in rows), rows
    hvd_rows = [{"bytes": r["bytes"], "hvd": r["mpi"] * 2} for r in rows]
    table = format_table({"hosts": 2, "ranks_per_host": 1, "shape": "unshaped",
                          "link_bits": None, "mpi": described, "mpi_rows": rows,
                          "hier": {"size": 2, "comm": "h", "rows": hvd_rows},
                          "flat": {"comm": "f", "rows": [{**r, "gloo": r["hvd"]}
                                                        for r in hvd_rows]}})
    # x mpi = MPI's time / ours: 0.50 for rows where ours took twice as long.
    assert table.splitlines()[-1].split()[-2] == "0.50", table
