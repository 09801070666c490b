"""The notebook progress bar's pure parts."""

from __future__ import annotations


def test_progress_bar_rendering():
    from hvd_spark.estimator.progress import _EPOCH, render

    assert render(3, 6, "loss=0.1") == "[" + "#" * 15 + "." * 15 + "] 3/6 epochs  loss=0.1"
    match = _EPOCH.match("[0] epoch 2/5: loss=0.5000, val_loss=0.4000")
    assert match and match.groups() == ("2", "5", "loss=0.5000, val_loss=0.4000")
    assert _EPOCH.match("[1] epoch 2/5: loss=1") is None
