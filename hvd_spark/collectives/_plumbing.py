"""What the framework bindings (and the benchmarks and tests) need besides the public API.

Not part of ``hvd_spark.collectives``' front door: naming an operation the way the engine
does (``auto_name``, ``group_base_name``), reporting a binding-side failure to the engine
(``report_failure``, ``report_grouped_failure``), and the running engine itself
(``current_engine``, for the bindings' device paths, the benchmarks and the tests).
"""

from __future__ import annotations

from hvd_spark.collectives.reduce_ops import report_grouped_failure
from hvd_spark.collectives.session import current_engine
from hvd_spark.collectives.submit import auto_name, group_base_name, report_failure

__all__ = ["auto_name", "current_engine", "group_base_name", "report_failure",
           "report_grouped_failure"]
