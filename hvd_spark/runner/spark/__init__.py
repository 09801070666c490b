"""The Spark launcher: barrier jobs of ``hvd_spark.run``, the tasks' side, Spark Connect.

Empty on purpose: a Spark task imports only the modules it runs.
"""
