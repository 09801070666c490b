"""Services on namespace hosts: a Spark standalone cluster and sshd (tests, benchmarks).

``SparkStandalone`` starts a real Spark standalone master on the bridge and one worker
per host from the pip pyspark; ``spark_cluster`` gives hosts, cluster and a session in one
context; ``SshServers`` runs an sshd on every host for ``hvdrun -H`` tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from netns_cluster.hosts import HarnessError, LinkShape, NetnsHosts, free_port, sh, stop


class SparkStandalone:
    """A Spark standalone master on the bridge and one worker on every host.

    Args:
        hosts: Started hosts.
        cores: Task slots (worker cores) per host.
        worker_memory: Memory each worker offers its executor.
        workdir: Where logs and the workers' directories go (a temporary one if None).
        worker_conf: Spark properties for every worker (its ``--properties-file``), e.g.
            ``spark.worker.resource.gpu.*``.
        worker_env: Variables set (a value) or removed (None) in the workers' environment
            and so their executors': e.g. the hosts' own ``PYSPARK_PYTHON`` and ``PATH``.
    """

    def __init__(self, hosts: NetnsHosts, cores: int = 1, worker_memory: str = "1g",
                 workdir: str | None = None,
                 worker_conf: Mapping[str, str] | None = None,
                 worker_env: Mapping[str, str | None] | None = None) -> None:
        self.hosts = hosts
        self.cores = cores
        self.worker_memory = worker_memory
        self.worker_conf = dict(worker_conf or {})
        self.worker_env = dict(worker_env or {})
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="hvd-multihost-")
        self.master_url = ""
        self._procs: list[subprocess.Popen] = []
        self._session: Any = None

    def _spark_env(self) -> tuple[str, dict[str, str]]:
        from pyspark.find_spark_home import _find_spark_home

        home = _find_spark_home()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_")}
        env.update({
            "SPARK_HOME": home, "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1",
        })
        return os.path.join(home, "bin", "spark-class"), env

    def start(self) -> SparkStandalone:
        """Start the master and the workers (returns before the workers registered)."""
        spark_class, env = self._spark_env()
        addr = self.hosts.bridge_addr
        port = free_port(addr)
        self.master_url = f"spark://{addr}:{port}"
        master_env = {**env, "SPARK_LOCAL_IP": addr}
        self._procs.append(subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", addr,
             "--port", str(port), "--webui-port", str(free_port(addr))],
            env=master_env, stdin=subprocess.DEVNULL,
            stdout=open(self.log_path("master"), "ab"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT, start_new_session=True))
        # A loaded machine can take longer to start a JVM than the driver and the
        # workers retry registering: wait until the master listens.
        self._wait_listening(addr, port, "master")
        extra: list[str] = []
        if self.worker_conf:
            props = os.path.join(self.workdir, "worker.properties")
            with open(props, "w") as f:
                f.writelines(f"{key}={value}\n" for key, value in self.worker_conf.items())
            extra = ["--properties-file", props]
        for i in range(self.hosts.count):
            worker_dir = os.path.join(self.workdir, f"worker{i}")
            os.makedirs(worker_dir, exist_ok=True)
            worker_env = {**env, "SPARK_LOCAL_IP": self.hosts.addrs[i],
                          "SPARK_LOCAL_DIRS": worker_dir}
            for key, value in self.worker_env.items():
                if value is None:
                    worker_env.pop(key, None)
                else:
                    worker_env[key] = value
            self._procs.append(self.hosts.popen(
                i, [spark_class, "org.apache.spark.deploy.worker.Worker", self.master_url,
                    "--host", self.hosts.addrs[i], "--cores", str(self.cores),
                    "--memory", self.worker_memory, "--work-dir", worker_dir,
                    "--webui-port", "0", *extra],
                env=worker_env, log_path=self.log_path(f"worker{i}")))
        return self

    def _wait_listening(self, addr: str, port: int, name: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection((addr, port), 1.0):
                return
            if time.monotonic() > deadline or self._procs[0].poll() is not None:
                raise HarnessError(f"the Spark {name} did not listen on {addr}:{port} within "
                                   f"{timeout:.0f} s; logs:\n{self.logs_tail()}")
            time.sleep(0.2)

    def log_path(self, name: str) -> str:
        """Where the master's (``master``) or a worker's (``workerI``) output goes."""
        return os.path.join(self.workdir, f"{name}.log")

    def logs_tail(self, lines: int = 15) -> str:
        """The last lines of every daemon's log, for error messages."""
        parts = []
        for name in ["master", *(f"worker{i}" for i in range(self.hosts.count))]:
            with contextlib.suppress(OSError), open(self.log_path(name), errors="replace") as f:
                parts.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(parts)

    def session(self, timeout: float = 120.0, executor_memory: str = "768m",
                conf: Mapping[str, str] | None = None) -> Any:
        """A SparkSession on the master, returned once every host's executor is up;
        ``conf`` adds (or overrides) application properties."""
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
        total = self.cores * self.hosts.count
        builder = (
            SparkSession.builder.master(self.master_url)
            .appName("hvd_spark-multihost")
            .config("spark.driver.host", self.hosts.bridge_addr)
            .config("spark.driver.bindAddress", self.hosts.bridge_addr)
            .config("spark.executor.cores", str(self.cores))
            .config("spark.cores.max", str(total))
            .config("spark.executor.memory", executor_memory)
            .config("spark.driver.memory", "1g")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", str(total))
            .config("spark.python.worker.reuse", "true")
        )
        for key, value in (conf or {}).items():
            builder = builder.config(key, value)
        self._session = builder.getOrCreate()
        self._wait_executors(timeout)
        return self._session

    def _wait_executors(self, timeout: float) -> None:
        sc = self._session.sparkContext
        deadline = time.monotonic() + timeout
        while True:
            # The driver's own block manager is in the list too.
            executors = sc._jsc.sc().getExecutorMemoryStatus().size() - 1
            if executors >= self.hosts.count:
                return
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"only {executors} of {self.hosts.count} executors registered within "
                    f"{timeout:.0f} s; daemon logs:\n{self.logs_tail()}")
            if any(p.poll() is not None for p in self._procs):
                raise HarnessError(f"a Spark daemon exited; logs:\n{self.logs_tail()}")
            time.sleep(0.5)

    def close(self) -> None:
        """Stop the session, the workers and the master; remove the temporary directory."""
        if self._session is not None:
            with contextlib.suppress(Exception):
                self._session.stop()
            self._session = None
        for proc in reversed(self._procs):
            stop(proc)
        self._procs.clear()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def spark_cluster(hosts: int, cores: int = 1, shape: LinkShape | None = None,
                  timeout: float = 120.0, worker_conf: Mapping[str, str] | None = None,
                  conf: Mapping[str, str] | None = None) -> Iterator[tuple[NetnsHosts, Any]]:
    """Hosts, a standalone cluster on them and a session: ``(hosts, spark)``; all torn down.
    ``worker_conf`` goes to the workers, ``conf`` to the session (``SparkStandalone``)."""
    net = NetnsHosts(hosts, shape).start()
    try:
        cluster = SparkStandalone(net, cores=cores, worker_conf=worker_conf).start()
        try:
            yield net, cluster.session(timeout, conf=conf)
        finally:
            cluster.close()
    finally:
        net.close()


class SshServers:
    """An sshd on every host, accepting one fresh key (for hvdrun -H tests).

    Attributes:
        identity: Private key file the client passes with ``-i``.
        client_opts: Extra ssh options for the client (``HVD_SPARK_SSH_OPTS``): no
            known_hosts file is read or written, so a user's is never touched.
    """

    client_opts = "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"

    def __init__(self, hosts: NetnsHosts, workdir: str, port: int = 22) -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.port = port
        self.identity = os.path.join(workdir, "client_key")
        self._procs: list[subprocess.Popen] = []

    def start(self, timeout: float = 20.0) -> SshServers:
        """Make the keys, start the servers and wait until each accepts connections."""
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.path.exists(sshd):
            raise HarnessError("sshd is not installed (apt-get install openssh-server)")
        host_key = os.path.join(self.workdir, "host_key")
        for key in (host_key, self.identity):
            sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key])
        authorized = os.path.join(self.workdir, "authorized_keys")
        shutil.copy(self.identity + ".pub", authorized)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        for i, addr in enumerate(self.hosts.addrs):
            options = {"HostKey": host_key, "AuthorizedKeysFile": authorized,
                       "StrictModes": "no", "PermitRootLogin": "prohibit-password",
                       "PasswordAuthentication": "no", "UsePAM": "no", "PidFile": "none",
                       "ListenAddress": f"{addr}:{self.port}", "PrintMotd": "no"}
            argv = [sshd, "-D", "-e", "-f", "/dev/null"]
            for key, value in options.items():
                argv += ["-o", f"{key}={value}"]
            self._procs.append(self.hosts.popen(
                i, argv, log_path=os.path.join(self.workdir, f"sshd{i}.log")))
        deadline = time.monotonic() + timeout
        for i, addr in enumerate(self.hosts.addrs):
            while True:
                with contextlib.suppress(OSError), socket.create_connection(
                        (addr, self.port), timeout=1.0):
                    break
                if time.monotonic() > deadline or self._procs[i].poll() is not None:
                    raise HarnessError(f"sshd on {self.hosts.hostnames[i]} did not start")
                time.sleep(0.1)
        return self

    def close(self) -> None:
        """Stop every sshd (sessions they started end with them)."""
        for proc in self._procs:
            stop(proc)
        self._procs.clear()
