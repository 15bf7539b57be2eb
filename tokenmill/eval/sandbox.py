"""Run untrusted generated Python in a subprocess with a wall-clock timeout, resource limits and a
guard that refuses writes outside the program's own temporary folder.

Layers, each catching what the others miss:
- a fresh temporary working directory, removed afterwards; `python -I` (no user site, no PYTHON* env);
- `resource.setrlimit` in the child before exec: CPU seconds, address space, file size, no core files;
- an audit hook (`sys.addaudithook`) installed before the program runs, refusing `open` for writing,
  removing/renaming/creating paths outside the folder, spawning processes and opening sockets;
- a wall-clock timeout that kills the child's whole process group (a sleeping loop uses no CPU).

This is a guard against accidents of generated code (a loop, a stray `open('/etc/x', 'w')`), not a
security boundary against a determined attacker: run evals of hostile models in a container.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

OUTPUT_TAIL_CHARS = 2000

# Runs in the child before the program; `ROOT` is the temporary folder (the child's cwd).
_GUARD = r'''
import os, sys
ROOT = os.path.realpath(os.getcwd())
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
                "os.link": 2, "os.symlink": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                "shutil.copyfile": 2, "shutil.move": 2}
_BLOCKED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "socket.connect", "socket.bind", "pty.spawn", "os.kill", "os.killpg", "ctypes.dlopen")

def _inside(path):
    if isinstance(path, int):
        return True  # an already-open descriptor (stdout, or one this program opened inside)
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == ROOT or real.startswith(ROOT + os.sep)

def _hook(event, args):
    if event == "open":
        path, mode, flags = (list(args) + [None, None])[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the temporary folder is refused: {path!r}")
    elif event in _PATH_EVENTS:
        for path in args[:_PATH_EVENTS[event]]:
            if not _inside(path):
                raise PermissionError(f"sandbox: {event} outside the temporary folder is refused: {path!r}")
    elif event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is refused")

sys.addaudithook(_hook)
del _hook
import runpy
runpy.run_path(sys.argv[1], run_name="__main__")
'''


@dataclass(frozen=True, slots=True)
class SandboxResult:
    passed: bool  # exit status 0 within the time limit
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    timeout_s: float = 5.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20


def _limit(limits: SandboxLimits) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="tokenmill-sandbox-") as folder:
        program = Path(folder) / "program.py"
        program.write_text(source, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": folder, "TMPDIR": folder,
               "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _GUARD, str(program)], cwd=folder, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, preexec_fn=lambda: _limit(limits),
        )
        timed_out = False
        try:
            stdout, stderr = process.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process.pid)
            stdout, stderr = process.communicate()
        code = process.returncode
        return SandboxResult(code == 0 and not timed_out, code, timed_out, stdout[-OUTPUT_TAIL_CHARS:],
                             stderr[-OUTPUT_TAIL_CHARS:])


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited on its own meanwhile
        os.killpg(pid, signal.SIGKILL)
