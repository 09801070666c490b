"""What a failed rank reports, and how the driver turns reports into one error."""

from __future__ import annotations

import dataclasses
import re
import signal
import time
import traceback

from hvd_spark.errors import PeerDisconnectedError

# How torch.distributed's backends say that a peer went away (gloo's transport, NCCL's
# watchdog, torch's store): such an error is a consequence of that peer's failure.
_PEER_LOSS = re.compile(
    r"Connection reset by peer|Connection closed by peer|gloo/transport/.*(Read|Write) error"
    r"|remote process exited|NCCL communicator was aborted|DistNetworkError|Broken pipe",
    re.IGNORECASE)


def is_peer_loss(exc: BaseException) -> bool:
    """True when ``exc`` says only that another rank disconnected (ours, or torch's)."""
    text = f"{type(exc).__name__}: {exc}"
    return (isinstance(exc, PeerDisconnectedError)
            or f"{PeerDisconnectedError.__name__}: " in text  # TensorFlow re-raises it
            or _PEER_LOSS.search(text) is not None)


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """One rank's failure.

    Attributes:
        rank: The failed rank.
        host: Host it ran on.
        message: ``Type: message`` of the error, or how the process ended.
        traceback: Formatted remote traceback ("" when the process died without one).
        timestamp: ``time.time()`` when the failure happened or was noticed.
        secondary: True when it is likely a consequence of another rank's failure.
        exit_code: The process's exit status when it ended without reporting (negative:
            killed by that signal); None when the rank reported an exception.
        lost: True when the rank's process, its Spark task or its executor vanished
            (killed, preempted, host gone) rather than ``fn`` raising: a retry may succeed.
    """

    rank: int
    host: str
    message: str
    traceback: str = ""
    timestamp: float = dataclasses.field(default_factory=time.time)
    secondary: bool = False
    exit_code: int | None = None
    lost: bool = False

    @classmethod
    def from_exception(cls, rank: int, host: str, exc: BaseException) -> WorkerFailure:
        """Describe an exception raised by ``fn`` on ``rank``."""
        return cls(
            rank=rank,
            host=host,
            message=f"{type(exc).__name__}: {exc}",
            traceback="".join(traceback.format_exception(exc)),
            secondary=is_peer_loss(exc),
        )

    @classmethod
    def from_exit(cls, rank: int, host: str, returncode: int, torn_down: bool,
                  escalated: bool = True) -> WorkerFailure:
        """Describe a process that ended without reporting (killed, or exited non-zero).

        ``torn_down``: the launcher was stopping the ranks when it ended; ``escalated``:
        it had already sent SIGKILL. A SIGKILL before that came from elsewhere (the OOM
        killer, a user, a fault): the process did not die of the teardown.
        """
        if torn_down and returncode == -signal.SIGKILL and not escalated:
            torn_down = False
        if returncode < 0:
            how = f"was killed by signal {-returncode}"
        else:
            how = f"exited with code {returncode} without reporting a result"
        if torn_down:
            how += " (stopped by the launcher after another rank failed)"
        return cls(rank=rank, host=host, message=f"process {how}", secondary=torn_down,
                   exit_code=returncode, lost=returncode < 0 and not torn_down)

    def shell_exit_code(self) -> int:
        """The status a launcher should exit with for this failure, as a shell reports it.

        The process's own non-zero code; 128 + N for a process killed by signal N;
        1 for a reported exception (what the rank's process exits with).
        """
        if self.exit_code is None or self.exit_code == 0:
            return 1
        return 128 - self.exit_code if self.exit_code < 0 else self.exit_code


