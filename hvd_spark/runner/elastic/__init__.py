"""Elastic jobs: the membership driver and its local (``hvdrun``) and Spark launchers.

Empty on purpose: a Spark task imports only the modules it runs.
"""
