"""A real local Spark Connect server for the tests: pip pyspark's own spark-submit
starting ``SparkConnectServer`` on ``local[2]``, on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
_START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ConnectServer:
    """Starts the server in its own process group; ``stop`` ends that group.

    Args:
        log_path: Where the server's output goes (read when it fails to start).
    """

    def __init__(self, log_path: Path) -> None:
        import pyspark

        self.port = _free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.log_path = log_path
        submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
        # The tests' functions are pickled by reference to their module (tests.*): the
        # executors import it from the checkout, as a user ships modules with addArtifacts.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        # The server's ranks are its executors' children: they must not see this client's
        # connect-mode switch, or their pyspark would look for a remote session.
        for key in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE"):
            env.pop(key, None)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(submit), "--master", "local[2]", "--class", _CLASS,
             "--conf", f"spark.connect.grpc.binding.port={self.port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.ui.enabled=false",
             "--conf", "spark.driver.memory=1g",
             "--conf", "spark.sql.shuffle.partitions=4",
             "--conf", "spark.python.worker.reuse=true"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)

    def wait_ready(self) -> None:
        """Block until the gRPC port accepts connections (bounded)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.5)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the Spark Connect server did not start:\n{tail}")

    def stop(self) -> None:
        """End the server and everything it started (its process group), bounded."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()
