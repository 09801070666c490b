"""Benchmarks: ``python -m hvd_spark.bench <name> ...``; each measures against a peer in one run."""
