"""The driver's own TensorBoard event files, read back by TensorBoard's reader."""

from __future__ import annotations

from hvd_spark.data.store import Store
from hvd_spark.estimator.run_record import RankLogs
from hvd_spark.estimator.tensorboard_events import EventFileWriter, crc32c


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283


def test_scalars_written_are_what_tensorboard_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = Store.create(str(tmp_path))
    writer = EventFileWriter(store, store.logs_path("r"))
    writer.add_scalars(1, {"loss": 0.5, "val_loss": 0.25, "name": "not a number"})
    writer.add_scalars(2, {"loss": 0.125})
    writer.add_scalars(-3, {"odd": 1})  # negative steps encode as protobuf int64s
    writer.close()
    acc = EventAccumulator(store.path(store.logs_path("r")))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "odd", "val_loss"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.125)]
    assert [(e.step, e.value) for e in acc.Scalars("odd")] == [(-3, 1.0)]


def test_rank_logs_are_one_file_per_rank_and_stream(tmp_path):
    store = Store.create(str(tmp_path))
    logs = RankLogs(store, "runs/x/logs")
    logs(1, "stderr", "Traceback (most recent call last):")
    logs(0, "stdout", "a")
    logs(0, "stdout", "b")
    logs.close()
    directory = tmp_path / "runs" / "x" / "logs"
    assert sorted(p.name for p in directory.iterdir()) == ["rank-0.stdout.log",
                                                           "rank-1.stderr.log"]
    assert (directory / "rank-0.stdout.log").read_text() == "a\nb\n"
