"""How many CPUs a rank may use: affinity capped by the cgroup CPU quota (a container's CPU
limit), which decides whether waiting ranks poll (EngineConfig.spin_seconds)."""

from __future__ import annotations

import os

from hvd_spark import config
from hvd_spark.config import DEFAULT_SPIN_US, EngineConfig, cgroup_cpu_quota, usable_cpus


def _tree(tmp_path, proc_line: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line + "\n")
    return str(root), str(proc)


def test_cgroup_v2_in_its_own_namespace(tmp_path):
    root, proc = _tree(tmp_path, "0::/", {"cpu.max": "150000 100000\n"})
    assert cgroup_cpu_quota(root, proc) == 1.5
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(root, proc) == min(affinity, 2)


def test_cgroup_v2_path_takes_the_tightest_quota_above_it(tmp_path):
    root, proc = _tree(tmp_path, "0::/kubepods/pod1/c1", {
        "kubepods/pod1/c1/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "50000 100000\n",
        "kubepods/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) == 0.5
    assert usable_cpus(root, proc) == 1


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    root, proc = _tree(tmp_path, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc", {
        "cpu/docker/abc/cpu.cfs_quota_us": "200000\n",
        "cpu/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(root, proc) == 2.0
    (tmp_path / "cgroup/cpu/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(root, proc) is None


def test_no_cgroup_information_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(str(tmp_path), str(tmp_path / "absent")) is None
    # This machine, for real: whatever its quota, the count stays within the affinity.
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def test_ranks_beyond_the_quota_wait_without_polling(monkeypatch):
    monkeypatch.setattr(config, "usable_cpus", lambda: 1)
    assert EngineConfig().spin_seconds(2) == 0.0
    monkeypatch.setattr(config, "usable_cpus", lambda: 4)
    assert EngineConfig().spin_seconds(2) == DEFAULT_SPIN_US / 1e6
