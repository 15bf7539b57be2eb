"""The CPU quota of a container (cgroup v1 and v2) caps the engine's default thread count."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tokenmill import platform


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_takes_the_tightest_limit_on_the_path(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/c1\n")
    _write(tmp_path / "fs/kubepods/pod1/c1/cpu.max", "150000 100000\n")
    assert platform.cpu_quota_cores(tmp_path / "fs", proc) == 1.5
    _write(tmp_path / "fs/kubepods/pod1/cpu.max", "100000 100000\n")  # the pod's limit is tighter
    assert platform.cpu_quota_cores(tmp_path / "fs", proc) == 1.0


def test_v2_without_a_limit_and_a_missing_file_are_no_quota(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    _write(proc, "0::/user.slice\n")
    _write(tmp_path / "fs/user.slice/cpu.max", "max 100000\n")
    assert platform.cpu_quota_cores(tmp_path / "fs", proc) is None
    assert platform.cpu_quota_cores(tmp_path / "fs", tmp_path / "absent") is None


def test_v1_reads_quota_over_period_under_the_cpu_mount(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    _write(proc, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    mount = tmp_path / "fs/cpu,cpuacct/docker/abc"
    _write(mount / "cpu.cfs_quota_us", "200000\n")
    _write(mount / "cpu.cfs_period_us", "100000\n")
    assert platform.cpu_quota_cores(tmp_path / "fs", proc) == 2.0
    _write(mount / "cpu.cfs_quota_us", "-1\n")  # unlimited
    assert platform.cpu_quota_cores(tmp_path / "fs", proc) is None


def test_v1_inside_a_container_reads_its_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    """The path names the host's cgroup; the container's mount shows its own at the root."""
    proc = tmp_path / "cgroup"
    _write(proc, "3:cpu:/docker/abc\n")
    _write(tmp_path / "fs/cpu/cpu.cfs_quota_us", "50000\n")
    _write(tmp_path / "fs/cpu/cpu.cfs_period_us", "100000\n")
    assert platform.cpu_quota_cores(tmp_path / "fs", proc) == 0.5


@pytest.mark.parametrize(("quota", "threads"), [(None, 2), (0.5, 1), (1.0, 1), (1.9, 1), (2.0, 2), (8.0, 2)])
def test_default_threads_are_the_quota_rounded_down(quota: float | None, threads: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform.torch, "get_num_threads", lambda: 2)
    assert platform.default_num_threads(quota) == threads


_V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(not (_V1_CPU / "cpu.cfs_quota_us").exists() or not os.access(_V1_CPU, os.W_OK),
                    reason="needs a writable cgroup v1 cpu controller (root on a v1 host)")
def test_a_process_in_a_real_one_cpu_cgroup_gets_one_thread() -> None:
    group = _V1_CPU / f"tokenmill-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as err:  # a read-only or delegated-elsewhere cgroup tree
        if group.is_dir():
            group.rmdir()
        pytest.skip(f"cannot make a cgroup here: {err}")
    try:
        # The child joins the cgroup itself before importing anything that starts threads.
        script = (f"import os; open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
                  "from tokenmill import platform\n"
                  "q = platform.cpu_quota_cores(); print(q, platform.default_num_threads(q))")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        if out.returncode != 0 and "cgroup.procs" in out.stderr:
            pytest.skip(f"cannot join a cgroup here: {out.stderr.strip().splitlines()[-1]}")
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1.0", "1"]
    finally:
        group.rmdir()
