"""The driver's progress bars (from structured events), INFO messages shown without any
logging set-up, and progress events from a process that no driver listens to."""

from __future__ import annotations

import io
import subprocess
import sys

from hvd_spark.estimator.progress import StepRate, TrainingProgress, format_metrics
from hvd_spark.runner import progress_events


def _step(epoch, step, loss, samples=64, elapsed=0.5, steps=4):
    return {"kind": "step", "epoch": epoch, "step": step, "steps": steps, "loss": loss,
            "samples": samples, "elapsed": elapsed}


def test_a_bar_per_epoch_with_loss_rate_and_a_line_of_metrics_that_stays():
    out = io.StringIO()
    bars = TrainingProgress(2, file=out)
    bars(0, _step(1, 1, 0.9, samples=64, elapsed=0.5))
    bars(0, _step(1, 3, 0.7, samples=192, elapsed=1.0))
    text = out.getvalue()
    assert "epoch 1/2" in text and "3/4" in text
    # The rate counts from the first step on: (192 - 64) rows in (1.0 - 0.5) s.
    assert "loss=0.7000" in text and "samples/s=256" in text
    bars(0, {"kind": "epoch", "epoch": 1, "epochs": 2,
             "metrics": {"loss": 0.65, "val_loss": 0.6}})
    bars(0, _step(2, 2, 0.5))
    bars(0, {"kind": "epoch", "epoch": 2, "epochs": 2, "metrics": {"loss": 0.4}})
    bars.close()
    assert bars.epoch_lines == ["epoch 1/2: loss=0.6500, val_loss=0.6000",
                                "epoch 2/2: loss=0.4000"]
    final = out.getvalue().replace("\r", "\n").splitlines()
    # The last drawing of each epoch's bar is complete and shows its metrics.
    assert any("epoch 1/2: 100%" in line and "val_loss=0.6000" in line for line in final)
    assert any("epoch 2/2: 100%" in line and "loss=0.4000" in line for line in final)


def test_an_epoch_without_step_events_still_gets_its_line():
    out = io.StringIO()
    bars = TrainingProgress(3, file=out)
    bars(0, {"kind": "epoch", "epoch": 1, "epochs": 3, "metrics": {"loss": 1.0, "x": "s"}})
    bars(0, {"kind": "unknown"})
    assert bars.epoch_lines == ["epoch 1/3: loss=1.0000"]
    assert out.getvalue() == "epoch 1/3: loss=1.0000\n"  # a plain line, no empty bar
    assert format_metrics({"epoch": 3, "loss": 0.5, "acc": 1}) == "loss=0.5000, acc=1.0000"


_SCRIPT = """
import logging
from hvd_spark.runner.console import verbose_logging
log = logging.getLogger("hvd_spark.data.writer")
with verbose_logging(1):
    log.info("reusing dataset abc")
with verbose_logging(0):
    log.info("quiet one")
log.info("outside")
"""


def test_info_messages_reach_stderr_without_any_logging_setup():
    # A fresh interpreter: pytest's own log handlers would count as a configuration.
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stderr.splitlines() == ["hvd_spark: reusing dataset abc"]


_CONFIGURED = """
import logging
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from hvd_spark.runner.console import verbose_logging
with verbose_logging(1):
    logging.getLogger("hvd_spark.runner").info("hidden")
    logging.getLogger("hvd_spark.runner").warning("shown")
"""


def test_an_application_logging_setup_is_left_alone():
    done = subprocess.run([sys.executable, "-c", _CONFIGURED], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stderr.splitlines() == ["WARNING shown"]


def test_without_a_listening_driver_events_are_not_sent(monkeypatch):
    monkeypatch.delenv("HVD_SPARK_RENDEZVOUS_ADDR", raising=False)
    monkeypatch.setattr(progress_events, "_CHANNEL", None)
    assert progress_events.available() is False
    assert progress_events.send(0, {"kind": "step"}) is False


def test_the_first_step_shows_no_rate_and_later_ones_leave_its_start_up_out():
    rate = StepRate()
    assert rate(_step(1, 1, 0.9, samples=32, elapsed=0.004)) is None  # 8000/s would be noise
    assert rate(_step(1, 5, 0.8, samples=160, elapsed=0.204)) == 640.0  # 128 rows in 0.2 s
    assert rate(_step(2, 1, 0.7, samples=32, elapsed=0.001)) is None  # each epoch afresh
    out = io.StringIO()
    bars = TrainingProgress(1, file=out)
    bars(0, _step(1, 1, 0.9, samples=32, elapsed=0.004))
    first = out.getvalue()
    assert "1/4" in first and "samples/s" not in first
    assert "?step/s" in first, "tqdm's own rate must not be one step over the bar's opening"
    bars(0, _step(1, 4, 0.8, samples=128, elapsed=0.104))
    bars.close()
    assert "samples/s=960" in out.getvalue()


def test_the_last_step_of_an_epoch_is_never_dropped_by_the_rate_limit():
    channel = progress_events._Channel()
    sent = []
    channel._usable = True
    channel._call = lambda rank, event: sent.append(event["step"]) or True
    for step in range(1, 5):  # a burst: far quicker than the rate limit
        channel.send(0, {"kind": "step", "epoch": 1, "step": step, "steps": 4})
    assert sent == [1, 4]
