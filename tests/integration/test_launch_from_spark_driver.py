"""Starting ranks from a Spark driver (a notebook that also uses Spark) must leave the
driver's own JVM connections alone: py4j pins one to every thread that calls the JVM."""

from __future__ import annotations

import io
import threading
import weakref

import pytest

from hvd_spark import run_local


def _one() -> int:
    return 1


@pytest.mark.smoke
def test_local_ranks_started_from_a_spark_driver_keep_its_jvm_connections(spark):
    client = spark.sparkContext._gateway._gateway_client
    jvm = spark.sparkContext._jvm
    ready, go_on = threading.Event(), threading.Event()
    seen: dict = {}

    def jvm_user():  # a thread of the driver with its own py4j connection
        jvm.java.lang.System.nanoTime()
        # Weakly: py4j's own references (its pool, the thread-local) must be all there is.
        seen["before"] = weakref.ref(client.get_thread_connection())
        ready.set()
        go_on.wait(60)
        jvm.java.lang.System.nanoTime()
        seen["after"] = client.get_thread_connection()

    thread = threading.Thread(target=jvm_user, name="jvm-user")
    thread.start()
    try:
        assert ready.wait(60)
        assert run_local(_one, num_proc=2, stdout=io.StringIO()) == [1, 1]
    finally:
        go_on.set()
        thread.join(60)
    # The same connection served the thread's next call: starting the ranks did not cut it
    # (py4j would have replaced a cut one with a new connection).
    assert seen["after"] is not None and seen["after"] is seen["before"]()
