"""Run a training job through a launch/ script, act on it mid-run, and report every exit status (test_stop_and_kill.py).

    python launcher_driver.py RESULT.json WATCH_FILE TRIGGER ACTION -- LAUNCH-COMMAND...

Starts LAUNCH-COMMAND in a new session, waits until WATCH_FILE shows TRIGGER, then:

* ``sigterm-launcher``: SIGTERM to the launcher process alone (what Kubernetes does to the
  container's first process).  The deepspeed runner dies without forwarding it; its children
  are orphaned.  This process is their subreaper (``PR_SET_CHILD_SUBREAPER``), so they are
  reparented here and every exit status can be collected;
* ``sigkill-all``: SIGKILL to the launcher and every process below it (a node lost in the middle of a
  save); found through /proc, since launchers put ranks in sessions of their own (torchrun does).

TRIGGER ``step:N`` waits for a metrics.jsonl record of step >= N; ``exists`` for the file to exist.
Writes ``{"statuses": {pid: status}, "launcher": status, "launcher_pid": pid}`` (a negative status: killed
by that signal).
"""
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

DEADLINE_S = 400  # generous: a loaded 2-core box once took 370 s for a job that takes ~80 s alone


def _triggered(path, trigger):
    if not os.path.exists(path):
        return False
    if trigger == "exists":
        return True
    want = int(trigger.split(":")[1])
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", -1) >= want and "loss" in json.loads(line):
                    return True
            except ValueError:  # a line being written
                pass
    return False


def _descendants(root):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _kill_all(root, orphans):
    """SIGKILL ``root``, everything below it, and the orphans already reparented here (all started by us)."""
    for pid in set(_descendants(root)) | set(orphans()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main():
    result, watch, trigger, action, sep, *command = sys.argv[1:]
    assert sep == "--"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    launcher = subprocess.Popen(command, start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    me = os.getpid()

    def orphans():  # processes reparented to this subreaper, other than the launcher
        return [p for p in _descendants(me) if p not in (me, launcher.pid)]

    while not _triggered(watch, trigger):
        if launcher.poll() is not None or time.monotonic() > deadline:
            _kill_all(launcher.pid, orphans)
            raise SystemExit(f"the job ended or timed out before {trigger} (launcher status {launcher.returncode})")
        time.sleep(0.05)
    if action == "sigterm-launcher":
        os.kill(launcher.pid, signal.SIGTERM)
    elif action == "sigkill-all":
        _kill_all(launcher.pid, orphans)
    else:
        raise SystemExit(f"unknown action {action}")
    # Whatever is left after the deadline is killed, never left running.
    signal.signal(signal.SIGALRM, lambda *_: _kill_all(launcher.pid, orphans))
    signal.alarm(max(int(deadline - time.monotonic()), 1))
    statuses = {}
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        statuses[pid] = os.waitstatus_to_exitcode(status)
    with open(result, "w") as f:
        json.dump({"statuses": statuses, "launcher": statuses.get(launcher.pid), "launcher_pid": launcher.pid}, f)


if __name__ == "__main__":
    main()
