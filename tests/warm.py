"""Child Python processes that start warm: `Popen` and `run`, as `subprocess`'s, for the
suite's children that run nebula and torch (campaigns, multi-rank jobs, crashes, exits).

Importing torch costs a child about 2 s of CPU, and the suite starts a few hundred such
children: a third of its CPU went there. Each pytest worker starts one *zygote*: this
file run as a script, which imports torch, torch.distributed and nebulaml once, then
waits on a Unix socket in the worker's scratch folder. A child is a `fork` of it: a real
process of its own (its own pid, signals, exit status, stdin/stdout/stderr the caller's
pipes, environment and working folder), which then runs the script, `-c` code or `-m`
module as `python` would, and exits through the interpreter's own shutdown (atexit,
non-daemon threads, flushed streams). The zygote reports the child's exit status; the
caller's `Popen` is `subprocess.Popen` in every other way (`communicate`, `wait`,
timeouts, `kill`).

What a forked child differs in from a fresh `python`: torch and nebulaml are imported
before its code runs (their import-time state is untouched: the zygote runs nothing), and
its parent is the zygote. Tests of a fresh process's first moments (imports, the cold
start) use `subprocess` itself. A launch the zygote cannot reproduce (another executable,
a shell, `pass_fds`, a user or group, an option other than -c/-m/-W/-u, PYTHON* settings
other than the zygote's) and any launch before the zygote is ready start a real process:
`subprocess.Popen`.

Not for: anything but the suite's children; the library never uses it.
"""

from __future__ import annotations

import array
import contextlib
import io
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve()
SOCKET_NAME = "zygote.sock"
COLD_ENV = "NEBULA_TESTS_COLD"  # set (to 1): every child starts as a real process
# Settings of a child's environment read when Python starts: a child whose differ from
# the zygote's starts a real process. PYTHONUNBUFFERED is applied to the child's streams.
_APPLIED = frozenset({"PYTHONUNBUFFERED"})


# The caller's side ------------------------------------------------------------------------
class _Zygote:
    """The worker's zygote process: `place` says where its socket goes, the first launch
    starts it (that launch, and those until it listens, start real processes), `stop`
    ends it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.path: str | None = None
        self.folder: str | None = None
        self.env: dict[str, str] = {}
        self.lock = threading.Lock()

    def start(self) -> None:
        """Start the zygote, listening in its folder; it is ready once its socket exists."""
        with self.lock:
            folder = self.folder
            if self.proc is not None or folder is None or os.environ.get(COLD_ENV):
                return
            path = os.path.join(folder, SOCKET_NAME)
            self.env = dict(os.environ)
            self.proc = subprocess.Popen(
                [sys.executable, str(_HERE), path],
                env=self.env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the terminal is not the zygote's
            )
            self.path = path

    def ready(self) -> str | None:
        """The socket's path if the zygote is up and listening, else None (it is started
        on the first call)."""
        if self.proc is None:
            self.start()
        if self.proc is None or self.path is None or self.proc.poll() is not None:
            return None
        return self.path if os.path.exists(self.path) else None

    def stop(self) -> None:
        """End the zygote (its children are the tests' to end)."""
        with self.lock:
            proc, self.proc = self.proc, None
            if proc is None:
                return
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if self.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)


ZYGOTE = _Zygote()


def place(folder: str) -> None:
    """This worker's zygote listens in `folder` (the worker's scratch folder), once a
    launch starts it: conftest.py."""
    ZYGOTE.folder = folder


def stop() -> None:
    """Stop this worker's zygote: conftest.py, at the worker's end."""
    ZYGOTE.stop()


def _python_spec(args: Any) -> dict[str, Any] | None:
    """What `args` runs (`_parse`), if it runs this interpreter as the zygote can."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return None
    args = [os.fspath(a) for a in args]
    if not args or any(not isinstance(a, str) for a in args):
        return None
    if os.path.realpath(args[0]) != os.path.realpath(sys.executable) and args[0] != sys.executable:
        return None
    return _parse(args[1:])


def _parse(args: list[str]) -> dict[str, Any] | None:
    """What `python ARGS` runs: {"warnings", "unbuffered", "mode", "target", "argv"}; None
    for an option the zygote does not reproduce."""
    warnings: list[str] = []
    unbuffered = False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-u":
            unbuffered = True
        elif arg == "-W" and i + 1 < len(args):
            i += 1
            warnings.append(args[i])
        elif arg.startswith("-W") and len(arg) > 2:
            warnings.append(arg[2:])
        elif arg in ("-c", "-m") and i + 1 < len(args):
            target = args[i + 1]
            rest = args[i + 2 :]
            argv = ["-c", *rest] if arg == "-c" else [target, *rest]
            return {"warnings": warnings, "unbuffered": unbuffered, "mode": arg,
                    "target": target, "argv": argv}  # fmt: skip
        elif arg.startswith("-"):
            return None
        else:
            return {"warnings": warnings, "unbuffered": unbuffered, "mode": "script",
                    "target": arg, "argv": args[i:]}  # fmt: skip
        i += 1
    return None  # an interactive interpreter


def _env_fits(env: dict[str, str]) -> bool:
    """Whether a child with `env` starts as the zygote did (the PYTHON* settings)."""
    mine = ZYGOTE.env
    keys = {k for k in (*env, *mine) if k.startswith("PYTHON") and k not in _APPLIED}
    return all(env.get(k) == mine.get(k) for k in keys)


def _send(sock: socket.socket, doc: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps(doc).encode()
    header = struct.pack("!I", len(data))
    sock.sendmsg([header + data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


class Popen(subprocess.Popen):  # type: ignore[type-arg]
    """`subprocess.Popen`, whose Python child is forked from the worker's zygote when it
    can be (see the module's docstring), else started as `subprocess` starts it."""

    _conn: socket.socket | None = None

    def _execute_child(  # type: ignore[override]
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Any,
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: Any,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        *rest: Any,
    ) -> None:
        restore_signals, gid, gids, uid, umask, start_new_session = rest[:6]
        process_group = rest[6] if len(rest) > 6 else -1
        spec = None if shell or executable is not None else _python_spec(args)
        child_env = dict(os.environ if env is None else env)
        plain = (
            preexec_fn is None
            and not pass_fds
            and (gid, gids, uid) == (None, None, None)
            and umask < 0
            and process_group in (None, -1)
            and restore_signals
        )
        conn = None
        # The zygote is started (on first use) only for a launch it can take.
        path = ZYGOTE.ready() if spec is not None and plain else None
        if path is not None and _env_fits(child_env):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(path)
            except OSError:  # the zygote ended meanwhile
                conn.close()
                conn = None
        if conn is None:
            super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                errwrite, *rest,
            )  # fmt: skip
            return
        # str keys and values only, as os.environ takes them
        doc = {
            "spec": spec,
            "env": {os.fsdecode(k): os.fsdecode(v) for k, v in child_env.items()},
            "cwd": os.fsdecode(cwd) if cwd is not None else os.getcwd(),
            "session": bool(start_new_session),
        }
        fds = [
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
        ]
        try:
            _send(conn, doc, fds)
            answer = _read_doc(conn)
        except OSError:
            conn.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if "error" in answer:
            conn.close()
            raise OSError(answer["error"])
        self.pid = int(answer["pid"])
        self._child_created = True
        self._conn = conn

    def _status(self, block: bool) -> int | None:
        """The child's wait status from the zygote, or None (not yet, `block` False)."""
        conn = self._conn
        assert conn is not None
        conn.setblocking(block)
        try:
            doc = _read_doc(conn)
        except BlockingIOError:
            return None
        except (OSError, ValueError):
            # The zygote ended first (stopped at the worker's end): the child, if alive, is
            # orphaned; no status comes. Said as a kill, as for a lost child.
            return -1
        finally:
            with contextlib.suppress(OSError):
                conn.setblocking(True)
        conn.close()
        return int(doc["status"])

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._conn is None:
            return super()._try_wait(wait_flags)  # type: ignore[misc]
        sts = self._status(block=not wait_flags & os.WNOHANG)
        if sts is None:
            return (0, 0)
        return (self.pid, sts if sts >= 0 else signal.SIGKILL)

    def _internal_poll(self, _deadstate: Any = None, **kwargs: Any) -> int | None:  # type: ignore[override]
        if self._conn is None:
            return super()._internal_poll(_deadstate=_deadstate, **kwargs)  # type: ignore[misc]
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
                return None
            try:
                if self.returncode is None:
                    pid, sts = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(sts)  # type: ignore[attr-defined]
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode


def _read_doc(conn: socket.socket) -> dict[str, Any]:
    """One length-prefixed JSON document from `conn` (BlockingIOError if none is there
    yet on a non-blocking socket; ValueError if the connection closed). Once its first
    byte is there, the rest is waited for."""
    if not conn.recv(1, socket.MSG_PEEK):
        raise ValueError("closed")
    conn.setblocking(True)
    (size,) = struct.unpack("!I", _read_exactly(conn, 4))
    return json.loads(_read_exactly(conn, size))


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise ValueError("closed")
        data += part
    return data


def run(*popenargs: Any, input: Any = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False, **kwargs: Any
        ) -> subprocess.CompletedProcess[Any]:  # fmt: skip
    """`subprocess.run`, its child started by `Popen` (warm where it can be)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(*popenargs, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        retcode = process.poll()
        assert retcode is not None
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, process.args, output=stdout,
                                                stderr=stderr)  # fmt: skip
    return subprocess.CompletedProcess(process.args, retcode, stdout, stderr)


# The zygote's side ------------------------------------------------------------------------
def _serve(path: str) -> dict[str, Any]:
    """Listen at `path`; fork a child per request. Returns only in a child: what it runs."""
    import torch
    import torch.distributed  # noqa: F401

    import nebulaml  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    os.rename(path + ".new", path)  # the caller takes its presence for "ready"
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    parent = os.getppid()
    while not stopping and os.getppid() == parent:  # a worker that died ends its zygote
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                continue
            conn, _ = listener.accept()
            try:
                doc, fds = _receive(conn)
            except (OSError, ValueError) as exc:
                with contextlib.suppress(OSError):
                    _answer(conn, {"error": f"zygote: {exc}"})
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                # The child: none of the zygote's files or handlers.
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                sel.close()
                listener.close()
                for other in (*children.values(), conn):
                    other.close()
                os.close(wake_r)
                os.close(wake_w)
                _become(doc, fds)
                return doc
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            _answer(conn, {"pid": pid})
        # Reap every child that ended; its caller learns its status.
        while children:
            try:
                pid, sts = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    _answer(conn, {"status": sts})
                conn.close()
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sys.exit(0)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if len(msg) < 4:
        raise ValueError("short request")
    (size,) = struct.unpack("!I", msg[:4])
    data = msg[4:]
    if len(data) < size:
        data += _read_exactly(conn, size - len(data))
    if len(fds) != 3:
        raise ValueError(f"{len(fds)} descriptors, not 3")
    return json.loads(data), list(fds)


def _answer(conn: socket.socket, doc: dict[str, Any]) -> None:
    data = json.dumps(doc).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _become(doc: dict[str, Any], fds: list[int]) -> None:
    """In the child: the caller's session, streams, environment and folder."""
    if doc["session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(doc["env"])
    os.chdir(doc["cwd"])
    spec = doc["spec"]
    unbuffered = spec["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _stream(0, unbuffered=False)
    sys.stdout = sys.__stdout__ = _stream(1, unbuffered=unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, unbuffered=unbuffered)
    if spec["warnings"]:
        import warnings

        sys.warnoptions[:] = spec["warnings"]
        warnings._processoptions(spec["warnings"])  # type: ignore[attr-defined]
    # torch's threads as a fresh process would size them (OMP_NUM_THREADS, else the cores)
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    # The thread this may start must take no signal: a signal for the process that it
    # took instead of the main thread (SIGINT, say) would not wake the main thread's
    # sleep, and the child ran on (a fresh process has no such thread before its code).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                              else (os.cpu_count() or 1))  # fmt: skip
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _stream(fd: int, *, unbuffered: bool) -> io.TextIOWrapper:
    """A standard stream on `fd` as Python makes it at its start: stdout line-buffered on
    a terminal, stderr always; with -u (PYTHONUNBUFFERED) no buffer under the text."""
    raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
    if fd == 0:
        return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8")
    buffer: Any = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffer,
        encoding="utf-8",
        errors="backslashreplace" if fd == 2 else "strict",
        line_buffering=fd == 2 or os.isatty(fd),
        write_through=unbuffered,
    )


def _run_child(doc: dict[str, Any]) -> None:
    """Run what `python ARGS` runs, as __main__, in this (forked) process."""
    import runpy
    import types

    spec = doc["spec"]
    sys.argv[:] = spec["argv"]
    if spec["mode"] == "-c":
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(spec["target"], "<string>", "exec"), main.__dict__)
    elif spec["mode"] == "-m":
        sys.path[0] = os.getcwd()
        runpy.run_module(spec["target"], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(spec["target"]))
        runpy.run_path(spec["target"], run_name="__main__")


if __name__ == "__main__":
    # This script's folder (tests/) is not a child's: sys.path[0] is set per child.
    _run_child(_serve(sys.argv[1]))
