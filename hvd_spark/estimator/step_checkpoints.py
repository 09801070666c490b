"""Checkpoints inside an epoch (``checkpoint_every_steps``) and where a fit resumes.

Epoch checkpoints are the store's ``epoch-NNNNNN.ckpt`` files. A step checkpoint is
``step-EEEEEE-SSSSSSSSS.ckpt`` beside them (epoch, 0-based, and training steps done in
it); only the newest is kept. Resuming takes whichever is newer: a step checkpoint
of the epoch after the last complete one wins. No pyspark here: the ranks use it too.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re

from hvd_spark.data.store import Store

_STEP_FILE = re.compile(r"step-(\d{6})-(\d{9})\.ckpt$")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where training continues.

    Attributes:
        epoch: First epoch to run (0-based).
        step: Training steps of ``epoch`` already done (0: the epoch starts afresh).
    """

    epoch: int
    step: int = 0

    def describe(self) -> str:
        """``epoch 4`` or ``epoch 4, step 21`` (1-based, as the history counts)."""
        return f"epoch {self.epoch + 1}" + (f", step {self.step + 1}" if self.step else "")


def _step_files(store: Store, run_id: str) -> list[tuple[int, int, str]]:
    found = []
    for name in store.list_files(store.checkpoints_path(run_id)):
        match = _STEP_FILE.match(name)
        if match:
            found.append((int(match.group(1)), int(match.group(2)), name))
    return sorted(found)


def save_step_checkpoint(store: Store, run_id: str, epoch: int, steps_done: int,
                         data: bytes) -> None:
    """Store the state after ``steps_done`` steps of ``epoch``; drop older step checkpoints."""
    directory = store.checkpoints_path(run_id)
    name = f"step-{epoch:06d}-{steps_done:09d}.ckpt"
    store.write_bytes(posixpath.join(directory, name), data)  # atomic: never half a file
    for _, _, old in _step_files(store, run_id):
        if old != name:
            store.delete(posixpath.join(directory, old))


def resume_point(store: Store, run_id: str) -> ResumePoint:
    """Where a fit of ``run_id`` continues, from the newest epoch or step checkpoint."""
    epochs = store.list_checkpoints(run_id)
    point = ResumePoint(epochs[-1] + 1 if epochs else 0)
    steps = _step_files(store, run_id)
    if steps and steps[-1][0] >= point.epoch:
        point = ResumePoint(steps[-1][0], steps[-1][1])
    return point


def read_step_checkpoint(store: Store, run_id: str, point: ResumePoint) -> bytes:
    """The bytes of the step checkpoint ``point`` names."""
    name = f"step-{point.epoch:06d}-{point.step:09d}.ckpt"
    return store.read_bytes(posixpath.join(store.checkpoints_path(run_id), name))
