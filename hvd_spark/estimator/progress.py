"""Live training progress on the driver, drawn from the ranks' structured events.

Rank 0's training loop sends ``step`` events (rate-limited) and one ``epoch`` event per
epoch through the run's driver service (``hvd_spark.runner.progress_events``).
``TrainingProgress`` draws one tqdm bar per epoch: steps done, ETA, the running loss
and samples/s while it runs; when the epoch ends its bar stays as one line with the
epoch's metrics. In Jupyter with ipywidgets the bar is a widget, elsewhere text
(what ``tqdm.auto`` picks, without its warning when ipywidgets is missing).

Rates are measured from an epoch's first step event on (``StepRate``): the first step
carries the epoch's start-up (the reader's first decode, Keras's graph tracing, the
bar's own opening), so a rate that includes it, or one over that single step, says
nothing about training speed. The first step shows no rate; the epoch's last step
event is always sent (``progress_events``), so a finished bar shows the epoch's rate.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Any


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not a plain IPython terminal)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return type(shell).__name__ == "ZMQInteractiveShell"


def _bar_class(file: IO[str] | None) -> Any:
    if file is None and in_notebook():
        try:
            import ipywidgets  # noqa: F401 - tqdm.notebook needs it
            from tqdm.notebook import tqdm

            return tqdm
        except ImportError:
            pass
    from tqdm.std import tqdm

    return tqdm


class StepRate:
    """Samples/s of the running epoch, from its first step event to the latest one.

    ``samples`` and ``elapsed`` of a step event count from the start of the epoch; the
    difference to the first event of the same epoch leaves the start-up out.
    """

    def __init__(self) -> None:
        self._first: tuple[Any, float, float] | None = None  # (epoch, samples, elapsed)

    def __call__(self, event: dict[str, Any]) -> float | None:
        """The rate after this step event; None for the first of an epoch."""
        samples, elapsed = event.get("samples"), event.get("elapsed")
        if samples is None or elapsed is None:
            return None
        if self._first is None or self._first[0] != event.get("epoch"):
            self._first = (event.get("epoch"), samples, elapsed)
            return None
        seconds = elapsed - self._first[2]
        return (samples - self._first[1]) / seconds if seconds > 0 else None


def format_metrics(metrics: dict[str, Any]) -> str:
    """``loss=0.3120, val_loss=0.2981`` (numbers only, in the order given)."""
    return ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()
                     if isinstance(v, (int, float)) and k != "epoch")


class TrainingProgress:
    """Receives ``(rank, event)`` from ``hvd_spark.run(progress=...)`` and draws the bars.

    Args:
        epochs: Epochs of the whole fit (the bars are titled ``epoch e/epochs``).
        file: Where text bars go; default stderr (or a widget in Jupyter).

    Attributes:
        epoch_lines: One ``epoch e/epochs: metrics`` string per finished epoch.
    """

    def __init__(self, epochs: int, file: IO[str] | None = None) -> None:
        self.epochs = epochs
        self.epoch_lines: list[str] = []
        self._file = file
        self._cls = _bar_class(file)
        self._bar: Any = None
        self._epoch: int | None = None
        self._steps: int | None = None
        self._rate = StepRate()
        self._lock = threading.Lock()

    def __call__(self, rank: int, event: dict[str, Any]) -> None:
        with self._lock:
            kind = event.get("kind")
            if kind == "step":
                self._on_step(event)
            elif kind == "epoch":
                self._on_epoch(event)

    def _open(self, epoch: int, steps: int | None, done: int = 0) -> None:
        self._close_bar()
        self._epoch = epoch
        self._steps = steps = steps or self._steps  # every epoch has as many steps
        kwargs: dict[str, Any] = {"file": self._file} if self._file is not None else {}
        # ``initial``: the steps done before the bar opened do not count in tqdm's own
        # step/s, which would otherwise be one step over the microseconds since opening.
        self._bar = self._cls(total=steps, desc=f"epoch {epoch}/{self.epochs}", unit="step",
                              leave=True, dynamic_ncols=self._file is None, initial=done,
                              mininterval=0, **kwargs)  # events come rate-limited

    def _on_step(self, event: dict[str, Any]) -> None:
        if self._bar is None or self._epoch != event["epoch"]:
            self._open(event["epoch"], event.get("steps"), event["step"])
        postfix = {"loss": f"{event['loss']:.4f}"}
        rate = self._rate(event)
        if rate is not None:
            postfix["samples/s"] = f"{rate:.0f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(max(event["step"] - self._bar.n, 0))  # redraws

    def _on_epoch(self, event: dict[str, Any]) -> None:
        epoch, metrics = event["epoch"], format_metrics(event["metrics"])
        line = f"epoch {epoch}/{self.epochs}: {metrics}"
        self.epoch_lines.append(line)
        if self._steps is None and (self._bar is None or self._epoch != epoch):
            self._close_bar()  # a loop without step events (Lightning): just the line
            self._cls.write(line, file=self._file)
            return
        if self._bar is None or self._epoch != epoch:
            self._open(epoch, event.get("steps"))
        self._bar.set_postfix_str(metrics, refresh=False)
        if self._bar.total:
            self._bar.update(self._bar.total - self._bar.n)
        self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()  # leave=True: the line stays
            self._bar = None

    def close(self) -> None:
        """Close a bar left open (a failed run)."""
        with self._lock:
            self._close_bar()
