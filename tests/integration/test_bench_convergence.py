"""``python -m hvd_spark.bench convergence`` end to end at its smallest: the plain torch loop
and TorchEstimator on 2 ranks, one seed and epoch, on the suite's local[2] session."""

from __future__ import annotations

import math
import re

import torch  # noqa: F401 - CI installs it: never a skip

from hvd_spark.bench import convergence


def _table_rows(out: str) -> list[list[str]]:
    """The Markdown table's data rows, as lists of cell texts."""
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def test_quick_torch_run_prints_both_rows_and_writes_a_png(spark, tmp_path, capsys):
    code = convergence.main(["--quick", "--frameworks", "torch", "--epochs", "1",
                             "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert spark.sparkContext._jsc is not None, "the suite's session must stay up"
    assert out.startswith("convergence: plain"), out  # the header says what is compared
    rows = _table_rows(out)
    assert [row[:2] for row in rows] == [["torch", "plain, 1 process"],
                                         ["torch", "TorchEstimator, 2 ranks"]], out
    for row in rows:
        assert row[2] == "128", row  # 2 ranks x 64 rows, and the plain batch
        numbers = [float(x) for cell in row[3:] for x in re.findall(r"\d+\.?\d*(?:e-?\d+)?",
                                                                     cell)]
        assert numbers and all(math.isfinite(x) for x in numbers), row
        assert 0.0 <= float(row[5]) <= 1.0, row  # one seed: the accuracy alone
    assert rows[0][3].split()[0] == rows[1][3].split()[0], "both runs step with one rate"
    png = tmp_path / "convergence.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
