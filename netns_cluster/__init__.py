"""Test support, not part of the wheel: several "hosts" on one machine.

``netns_cluster.hosts`` builds network namespaces on a bridge (one per host, with shaped
links); ``netns_cluster.services`` starts a Spark standalone cluster and sshd on them. The
multi-host tests (``tests/multihost``) and the benchmarks' ``--hosts`` / ``scaling`` modes
use it from a source checkout; an installed wheel does not have it.
"""
