"""Children started by `specdec up`, the benchmarks and the tests: they die with the thread that
started them (a run killed by a signal leaves nothing behind), start safely from a process that
runs threads, and are the process Popen returns (signals reach the program itself)."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from specdec.app.launcher import guarded

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: its parent has not reaped it yet
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@linux
def test_a_guarded_child_is_killed_when_the_process_that_started_it_is_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    starter = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from specdec.app.launcher import guarded\n"
        "p = subprocess.Popen(guarded(['sleep', '120']))\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n")])
    try:
        end = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < end:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        time.sleep(0.3)  # the shim has exec'd `sleep` by now
        assert _alive(child)
        starter.kill()  # SIGKILL: no clean-up runs in the starter
        starter.wait()
        end = time.monotonic() + 10
        while _alive(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived the process that started it"
    finally:
        starter.kill()


def test_the_guarded_child_is_the_process_popen_returns_and_gets_its_signals():
    proc = subprocess.Popen(guarded([sys.executable, "-c",
                                     "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert int(proc.stdout.readline()) == proc.pid  # exec'd in place, not a grandchild
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM
    finally:
        proc.kill()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_guarded_child_runs_on_the_cpus_it_is_given():
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run(guarded([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                 cpus={cpu}), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([cpu])


def test_children_start_from_a_process_whose_threads_are_busy():
    """Code run between fork and exec in a process with threads can crash on a lock another thread
    held (a redis-server start died of SIGSEGV so): every start here must reach the program."""
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            bytearray(1 << 16)
            __import__("json").dumps({"x": list(range(50))})

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        codes = [subprocess.run(guarded(["true"]), timeout=30).returncode for _ in range(20)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert codes == [0] * 20
