"""``hvd_spark.TorchDistributor``: pyspark's ``TorchDistributor``, on hvd_spark's ranks.

The same constructor and ``run`` semantics as ``pyspark.ml.torch.distributor``, so a
notebook cell changes only its import: ``run(fn, *args, **kwargs)`` returns rank 0's
return value; ``run("train.py", *cli_args)`` runs the file as ``__main__`` in every rank
and returns None. Each rank gets torchrun's environment (``runner.torch_world``), so
``torch.distributed.init_process_group()`` with no arguments joins the job. Ranks start
through ``run_local`` (``local_mode=True``: processes on the driver) or ``run`` (barrier
tasks), with their supervision: a rank that dies or freezes ends the job in seconds,
naming it, instead of torch's 30-minute collective timeout.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

from hvd_spark.errors import ConfigError

log = logging.getLogger("hvd_spark.distributor")

_TASK_GPUS = "spark.task.resource.gpu.amount"
_DRIVER_GPUS = "spark.driver.resource.gpu.amount"


def check_num_processes(num_processes: Any) -> int:
    """``num_processes`` as a positive int.

    Raises:
        ValueError: It is not a positive integer.
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) \
            or num_processes <= 0:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    return num_processes


def run_script(path: str, argv: list[str], source: str) -> None:
    """Run the Python file ``path`` as ``__main__`` with ``sys.argv = [path, *argv]``.

    Where ``path`` does not exist (an executor that has not got the driver's file), the
    driver's ``source`` runs under the same name. ``sys.exit(0)`` (or ``None``) is success.

    Raises:
        SystemExit: The script exited with a non-zero status.
    """
    sys.argv = [path, *argv]
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)  # as `python train.py` does: its sibling modules import
    try:
        if os.path.isfile(path):
            runpy.run_path(path, run_name="__main__")
        else:
            module = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
            exec(compile(source, path, "exec"), module)  # noqa: S102 - the user's script
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


def _spark_conf(key: str) -> str | None:
    from hvd_spark.runner.spark import spark_launcher

    sc = spark_launcher.cluster_context(spark_launcher.active_session())
    return sc.getConf().get(key, None)


class TorchDistributor:
    """Run torch.distributed (or Horovod-API) training on Spark, as pyspark's does.

    Args:
        num_processes: Number of processes (ranks) in the job.
        local_mode: True: the processes run on the driver; False: on Spark barrier tasks,
            one process per task, or with GPUs one per GPU of the task
            (``spark.task.resource.gpu.amount`` processes in each of
            ``num_processes / amount`` tasks), as pyspark does.
        use_gpu: Give each process its GPU (as pyspark's default, True). On tasks this
            needs ``spark.task.resource.gpu.amount``; in local mode, driver GPUs
            (``spark.driver.resource.gpu.amount``). Pass False to train on CPUs (gloo).
        _ssl_conf: pyspark's keyword, accepted and ignored: hvd_spark authenticates every
            connection with the job's secret.

    Raises:
        ValueError: ``num_processes`` is not a positive integer, or the GPU settings
            cannot give each process a GPU (naming the Spark setting).
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 _ssl_conf: str | None = None) -> None:
        self.num_processes = check_num_processes(num_processes)
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)
        self._driver_gpus: list[str] = []
        self.ranks_per_task = 1
        self.num_tasks = self._num_tasks()

    def _num_tasks(self) -> int:
        if not self.use_gpu:
            return self.num_processes
        if self.local_mode:
            self._driver_gpus = _driver_gpus()
            if self.num_processes > len(self._driver_gpus):
                log.warning(
                    "TorchDistributor: num_processes=%d but the driver has %d GPUs "
                    "(%s): num_processes is lowered to %d, one process per GPU",
                    self.num_processes, len(self._driver_gpus), _DRIVER_GPUS,
                    len(self._driver_gpus))
                self.num_processes = len(self._driver_gpus)
            return self.num_processes
        amount = _spark_conf(_TASK_GPUS)
        if not amount:
            raise ConfigError(
                f"TorchDistributor(use_gpu=True, local_mode=False) needs {_TASK_GPUS}: this "
                "Spark session schedules no GPUs to tasks. Start it with "
                "spark.executor.resource.gpu.amount, spark.executor.resource.gpu."
                f"discoveryScript and {_TASK_GPUS}=1, or pass use_gpu=False to train on CPUs")
        try:
            per_task = float(amount)
        except ValueError:
            raise ConfigError(f"{_TASK_GPUS}={amount!r} is not a number") from None
        if per_task < 1 or per_task != int(per_task):
            raise ConfigError(
                f"{_TASK_GPUS}={amount}: TorchDistributor gives each process a whole GPU; "
                f"set {_TASK_GPUS} to a whole number of GPUs per task (1, or all of a "
                "node's GPUs to run one process per GPU in each task)")
        self.ranks_per_task = int(per_task)
        if self.num_processes % self.ranks_per_task:
            raise ConfigError(
                f"num_processes={self.num_processes} must be a multiple of {_TASK_GPUS}="
                f"{self.ranks_per_task}: each task runs one process per GPU it holds")
        return self.num_processes // self.ranks_per_task

    def run(self, train_object: Callable | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object`` on every process.

        Args:
            train_object: A function, run as ``train_object(*args, **kwargs)``; or the path
                of a Python file, run as ``__main__`` with ``args`` as its command line.
            *args: The function's positional arguments, or the file's arguments (strings).
            **kwargs: The function's keyword arguments (none for a file).

        Returns:
            Rank 0's return value for a function; None for a file.

        Raises:
            ValueError: A file with keyword arguments, or a file that does not exist.
            WorkerFailedError: A process failed; the others were stopped.
        """
        if isinstance(train_object, str):
            if kwargs:
                raise ValueError("TorchDistributor.run(path, ...) takes the file's command-line "
                                 f"arguments as strings, not keyword arguments {sorted(kwargs)}")
            if not os.path.isfile(train_object):
                raise ValueError(f"TorchDistributor.run: no such Python file {train_object!r}")
            with open(train_object, encoding="utf-8") as f:
                source = f.read()
            self._launch(run_script, (train_object, [str(a) for a in args], source), {})
            return None
        if not callable(train_object):
            raise ValueError("TorchDistributor.run takes a function or the path of a Python "
                             f"file, got {type(train_object).__name__}")
        return self._launch(train_object, args, kwargs)[0]

    def train_on_dataframe(self, train_function: Callable, df: Any, *args: Any,
                           **kwargs: Any) -> Any:
        """Run ``train_function(*args, **kwargs)`` on barrier tasks that hand each process
        its share of ``df``, straight from Spark (no Store; ``hvd_spark.run``'s ``df=``).

        Inside, ``hvd_spark.torch.dataframe.dataframe_loader(batch_size)`` gives a
        ``DataLoader`` over the process's rows (pyspark has this as a private method).

        Returns:
            Rank 0's return value.

        Raises:
            ValueError: ``local_mode=True`` (the shares come from Spark tasks), or a column
                no model can take (naming it).
            WorkerFailedError: A process failed; the others were stopped.
        """
        if self.local_mode:
            raise ValueError("TorchDistributor.train_on_dataframe needs local_mode=False: "
                             "each Spark task hands its rows to its process")
        if self.ranks_per_task != 1:
            raise ValueError(
                f"TorchDistributor.train_on_dataframe runs one process per task, but "
                f"{_TASK_GPUS}={self.ranks_per_task}: set it to 1 to train on a DataFrame")
        if not callable(train_function):
            raise ValueError(f"train_function must be callable, got "
                             f"{type(train_function).__name__}")
        from hvd_spark.runner.api import run_with_report

        env = None if self.use_gpu else {"CUDA_VISIBLE_DEVICES": ""}
        return run_with_report(train_function, args=args, kwargs=kwargs,
                               num_proc=self.num_processes, env=env, use_gpu=self.use_gpu,
                               df=df).results[0]

    def _launch(self, fn: Callable, args: tuple, kwargs: dict) -> list:
        if self.local_mode:
            from hvd_spark.runner.local.local_launcher import run_local

            # Every process sees the driver's GPUs of the job and uses the one at its
            # LOCAL_RANK, as under torchrun; without GPUs, none (gloo on CPUs).
            visible = ",".join(self._driver_gpus[:self.num_processes]) if self.use_gpu else ""
            return run_local(fn, args=args, kwargs=kwargs, num_proc=self.num_processes,
                             env={"CUDA_VISIBLE_DEVICES": visible})
        from hvd_spark.runner.api import run_with_report

        env = None if self.use_gpu else {"CUDA_VISIBLE_DEVICES": ""}
        return run_with_report(fn, args=args, kwargs=kwargs, num_proc=self.num_processes,
                               env=env, use_gpu=self.use_gpu,
                               ranks_per_task=self.ranks_per_task).results


def _driver_gpus() -> list[str]:
    """The driver's GPU addresses as Spark knows them (``spark.driver.resource.gpu.*``).

    Raises:
        ValueError: The driver has none, naming the settings that give it some.
    """
    from hvd_spark.runner.spark import spark_launcher
    from hvd_spark.runner.spark.connect import is_connect

    session = spark_launcher.active_session()
    resources: dict = {}
    if not is_connect(session):  # a Connect client has no driver resources to read
        resources = session.sparkContext.resources
    gpus = list(resources["gpu"].addresses) if "gpu" in resources else []
    if not gpus:
        raise ConfigError(
            "TorchDistributor(use_gpu=True, local_mode=True) runs the processes on the driver "
            f"and found no driver GPUs: start the session with {_DRIVER_GPUS} and "
            "spark.driver.resource.gpu.discoveryScript, or pass use_gpu=False to train on CPUs")
    return gpus
