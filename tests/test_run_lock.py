"""One writer per run folder: ``run_folder.hold_lock`` / ``run_lock``, taken by ``continual-blr run`` (``--out``,
``--resume``, ``--seeds``) and by ``benchmarks/reproduce.py --work-dir``.

Guarantees checked: a second process that would write a folder being written is refused with one line naming the
holder, and touches nothing (planted: the CLI without its lock overwrites the first run's ``results.json``); the
lock dies with its holder, also under ``kill -9``; a folder the lock created for a run that never started is removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from continual_blr.cli import main
from continual_blr.run_folder import LOCK, RunInUseError, hold_lock, run_lock

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="flock: POSIX only")

CONFIG = ("stream: {name: synthetic, options: {n_tasks: 2, n_train: 40}}\nmodel: {hidden: [8]}\n"
          "train: {epochs: 1, batch_size: 20}\nmethods: [none]\n")


def _holder(lock_file):
    """A separate process that takes the lock, says so on stdout, then sleeps."""
    code = textwrap.dedent(f"""
        import sys, time
        from continual_blr.run_folder import hold_lock
        with hold_lock({str(lock_file)!r}):
            print("held", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_and_the_lock_dies_with_its_holder(tmp_path):
    lock_file = tmp_path / "run" / LOCK
    proc = _holder(lock_file)
    try:
        with pytest.raises(RunInUseError, match=rf"being written by another run \(pid {proc.pid} ") as err:
            with hold_lock(lock_file):
                pass
        assert len(str(err.value).splitlines()) == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert lock_file.exists()  # the killed holder left the file behind ...
    with hold_lock(lock_file):  # ... and it no longer blocks
        assert lock_file.read_text().startswith(f"pid {os.getpid()} ")
    assert not lock_file.exists()


def test_the_cli_refuses_to_overwrite_or_resume_a_run_being_written(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG)
    out = tmp_path / "r"
    assert main(["run", str(p), "--out", str(out), "--no-progress"]) == 0
    before = (out / "results.json").read_bytes()
    capsys.readouterr()
    with run_lock(out):  # another writer (flock conflicts between two open files, also in one process)
        for flag, argv in (("--out", ["run", str(p), "--out", str(out), "--overwrite", "--no-progress"]),
                           ("--resume", ["run", "--resume", str(out), "--no-progress"]),
                           ("--out", ["run", str(p), "--seeds", "0", "1", "--out", str(out), "--overwrite",
                                      "--no-progress"])):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith(f"continual-blr: error: {flag}: {out} is being written by another run (pid "), err
            assert len(err) == 1 or "has finished" in err[0]  # --resume first notes that the run had finished
            assert (out / "results.json").read_bytes() == before
    assert main(["run", str(p), "--out", str(out), "--overwrite", "--no-progress"]) == 0  # released: runs again
    assert not (out / LOCK).exists()  # a finished run leaves no lock file


def test_a_folder_the_lock_created_is_removed_if_the_run_wrote_nothing(tmp_path):
    folder = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with run_lock(folder):
            assert (folder / LOCK).is_file()
            raise RuntimeError("bad input")
    assert not folder.exists()
    existing = tmp_path / "old"
    existing.mkdir()
    with run_lock(existing):
        pass
    assert existing.is_dir()  # a folder that was there stays


def test_reproduce_work_dir_runs_are_locked(tmp_path):
    """``reproduce.run_resumable`` refuses, with one line, a work folder another process is running."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import reproduce
    finally:
        sys.path.pop(0)
    work = tmp_path / "none_seed0"
    proc = _holder(work.with_name(work.name + ".lock"))
    try:
        t0 = time.monotonic()
        with pytest.raises(SystemExit, match=r"--work-dir: .*none_seed0 is being written by another run"):
            reproduce.run_resumable(None, work)
        assert time.monotonic() - t0 < 5  # refused at once, not after waiting
        assert not work.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_lock_on_a_file_removed_meanwhile_is_taken_again_on_the_new_file(tmp_path, monkeypatch):
    """The race the removal at release opens: a process opens the lock file, the holder removes it and releases,
    the process then locks the removed file. ``hold_lock`` must notice (inode check) and lock the file at the path,
    else two runs could each hold "the" lock. Simulated: the first flock call removes the file it just locked."""
    import fcntl

    lock_file = tmp_path / "run" / LOCK
    real, calls = fcntl.flock, []

    def flock_then_vanish(fd, op):
        real(fd, op)
        calls.append(op)
        if len(calls) == 1 and op & fcntl.LOCK_EX:
            lock_file.unlink()  # the previous holder's release, between our open and our lock

    monkeypatch.setattr(fcntl, "flock", flock_then_vanish)
    with hold_lock(lock_file):
        assert lock_file.exists()  # we hold the file that is at the path, not the removed one
        assert lock_file.read_text().startswith(f"pid {os.getpid()} ")
    assert len([c for c in calls if c & fcntl.LOCK_EX]) == 2
