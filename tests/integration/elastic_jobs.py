"""An elastic job the Spark tests run on real executors (importable by the workers)."""

from __future__ import annotations

import time


def count_steps(steps: int, commit_every: int = 1, pause_s: float = 0.0,
                tag: str = "") -> tuple[int, int, int, float]:
    """Sum one allreduce of ones per step, elastically, until ``steps`` steps are done.

    Every ``commit_every`` steps it commits and, when ``tag`` is given, prints
    ``step N size S <tag>`` (tests watch these lines to act mid-run).

    Returns:
        ``(rank, size, steps done, total)``: the total counts each step's ranks once.
    """
    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, total=0.0)

    @hvd.elastic.run
    def loop(state):
        while state.step < steps:
            state.total += float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])
            state.step += 1
            if state.step % commit_every == 0:
                state.commit()
                if tag:
                    print(f"step {state.step} size {hvd.size()} {tag}", flush=True)
            time.sleep(pause_s)
        return hvd.rank(), hvd.size(), state.step, state.total

    return loop(state)


def count_steps_killing(steps: int, victims: dict[str, int], pause_s: float = 0.05
                        ) -> tuple[int, int, int, float]:
    """``count_steps``, where worker ``w`` of ``victims`` SIGKILLs itself at step
    ``victims[w]`` (its process dies as a crash or the OOM killer would kill it)."""
    import os
    import signal

    import numpy as np

    import hvd_spark.collectives as hvd
    from hvd_spark import _env

    hvd.init()
    dies_at = victims.get(os.environ.get(_env.WORKER_ID, ""))
    state = hvd.elastic.ObjectState(step=0, total=0.0)

    @hvd.elastic.run
    def loop(state):
        while state.step < steps:
            if state.step == dies_at:
                os.kill(os.getpid(), signal.SIGKILL)
            state.total += float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])
            state.step += 1
            state.commit()
            time.sleep(pause_s)
        return hvd.rank(), hvd.size(), state.step, state.total

    return loop(state)


def count_steps_freezing_in_the_first_ring(steps: int, victim: str, freeze_s: float
                                           ) -> tuple[int, int, int, float]:
    """``count_steps``, where worker ``victim`` freezes (SIGSTOP) for ``freeze_s`` right
    after it got its place in the first generation, before that ring has connected.

    A rank frozen as its ring forms: the launcher declares it lost while the others still
    wait for it to connect; when it resumes, the ring connects, but it is one the launcher
    has given up, and must not train on.
    """
    import os
    import signal
    import subprocess

    from hvd_spark import _env
    from hvd_spark.collectives import membership

    join = membership.Membership.join

    def join_then_freeze(self: membership.Membership):
        world = join(self)
        if self.worker == victim and self.generation == 1:
            # A process cannot resume itself: a sibling sends the SIGCONT.
            subprocess.Popen(["sh", "-c", f"sleep {freeze_s}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        return world

    if os.environ.get(_env.WORKER_ID) == victim:
        membership.Membership.join = join_then_freeze
    return count_steps(steps, commit_every=2, pause_s=0.01)
