"""A warm template process that forks a fresh child for each command a test runs.

A test that runs `python workload.py ...` or `python -m steadytrain.cli ...` pays for importing
torch (3 s of CPU) or peft (11 s) in every child; on CI's 2 cores that was most of the suite.
The server here imports them once, runs nothing else (no thread pool started, no tensor made),
and answers each request by forking: the child sets the request's environment, working folder,
argv and files for its standard streams, runs the script or module as `__main__`, and ends as
the interpreter would (non-daemon threads joined, atexit handlers run, exit code or signal).
The test gets a handle like `subprocess.Popen`'s: a real process with its own pid, killable with
any signal, whose exit code or signal comes back.

What a fork cannot change is what the C libraries read once at process start: glibc's malloc
settings (MALLOC_*), OpenMP's (OMP_*, KMP_*, GOMP_*), the loader's (LD_*). `start` keeps one
server per value of those variables, started with them, so a child under `MALLOC_ENV` gets
glibc's settings as a fresh process would. Commands that are not `python SCRIPT` or `python -m
MODULE` (torchrun, a shell), and any run with STEADYTRAIN_TEST_FORK=0, get a plain
`subprocess.Popen`.

The xdist workers of one pytest run share each server: the first worker that needs one starts
it, the others connect to its Unix socket (in a folder named by the run's id, found under a
lock), and it ends when no worker is connected any more. A server costs 5 to 15 CPU seconds to
start (torch, torch._dynamo, transformers and peft imported); one per worker per setting was
tens of seconds of the suite.

Protocol (JSON lines on the worker's connection): the server says {"hello": N, "ranks": PATH}
(the worker's number, the ranks' socket); request {"id", "argv", "env", "cwd", "stdin",
"stdout", "stderr", "new_group"}; replies {"id", "pid"} when the child started and {"id", "exit",
"cpu"} when it ended (negative: killed by that signal). A worker that ends takes its children
with it, as when each had its own server.

torchrun's ranks: torchrun starts each rank itself (`python -u SCRIPT`), out of reach of the
test. `torchrun_command` puts tests/forkrank.py before the script: a client of a few stdlib
imports that hands its standard streams (SCM_RIGHTS), argv, environment and folder to the
server over a Unix socket, forwards the signals torchrun sends, and ends as the forked rank
ended (its exit code, or killed by the same signal). When the client dies (torchrun's SIGKILL),
the server kills its rank.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PRELOAD = ("torch", "torch._dynamo", "steadytrain.trainer.fit", "steadytrain.cli")
"""What the server imports before it forks: what the children would each import again."""
PRELOAD_LM = ("transformers", "peft")
"""Imported too by the server without glibc settings of its own (fine-tunes run under it; the
capped workloads under MALLOC_* settings never import them)."""

SOCKET = "STEADYTRAIN_TEST_FORK_SOCKET"
"""Where a server listens for torchrun's ranks (tests/forkrank.py reads it)."""
CLIENT = "STEADYTRAIN_TEST_FORK_CLIENT"
"""Which test process ran the torchrun (forkrank.py sends it: the rank's CPU is that test's)."""
CONTROL = "STEADYTRAIN_TEST_FORK_CONTROL"
"""Where a server listens for the test processes that share it."""

# Read by C libraries when the process starts: a child with other values needs its own server.
AT_START = re.compile(r"^(MALLOC_|GLIBC_TUNABLES$|OMP_|KMP_|GOMP_|MKL_|OPENBLAS_|LD_|PYTHONPATH$)")


# -- the server (runs as `python forkserver.py`) --------------------------------------------------


def _serve() -> None:
    lm = () if any(k.startswith("MALLOC_") for k in os.environ) else PRELOAD_LM
    for name in (*PRELOAD, *lm):
        __import__(name)
    if threading.active_count() != 1:  # (torch's own idle native thread is fork-safe)
        raise SystemExit("forkserver: a preloaded module started a thread; forking is not safe")
    control = os.environ[CONTROL]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(control)  # a server of this run that was killed (its starter holds the lock)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(control)
    listener.listen(64)
    clients: dict[socket.socket, _Client] = {}
    running: dict[int, tuple[_Client, int]] = {}  # pid -> the client and its request id
    ranks = _Ranks(os.environ[SOCKET])
    if os.fork():  # the process its starter started ends here: the server is no test's child
        os._exit(0)
    os.write(1, b'{"ready": true}\n')
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # its starter may end before it: nothing more goes to that pipe
    os.close(devnull)
    served = 0
    while True:
        waiting = [listener, *clients, *ranks.waiting()]
        readable, _, _ = select.select(waiting, [], [], 0.02)
        ranks.serve(readable)
        if listener in readable:
            connection = listener.accept()[0]
            served += 1
            clients[connection] = client = _Client(connection, served)
            client.reply({"hello": served, "ranks": os.environ[SOCKET]})
        for connection in [c for c in clients if c in readable]:
            client = clients[connection]
            requests = client.read()
            if requests is None:  # its test process is gone: so are the children it asked for
                del clients[connection]
                connection.close()
                for pid, (owner, _) in list(running.items()):
                    if owner is client:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                continue
            for request in requests:
                pid = os.fork()
                if pid == 0:
                    for own in (listener, *clients):
                        own.close()
                    _child(request)  # never returns
                running[pid] = (client, request["id"])
                client.reply({"id": request["id"], "pid": pid})
        while running or ranks.pids():
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            cpu = usage.ru_utime + usage.ru_stime  # its own and its reaped descendants'
            exit_code = os.waitstatus_to_exitcode(status)
            if pid in running:
                client, ident = running.pop(pid)
                client.reply({"id": ident, "exit": exit_code, "cpu": cpu})
            else:
                asker = ranks.ended(pid, exit_code)
                for client in clients.values():
                    if client.number == asker:  # counts the rank's CPU for the test that ran it
                        client.reply({"id": -1, "exit": exit_code, "cpu": cpu})
        if not clients and served and _may_end(control, listener):
            break
    for pid in [*running, *ranks.pids()]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ranks.close()


def _may_end(control: str, listener: socket.socket) -> bool:
    """Whether the server may end now that no test process is connected: only while no test
    process is between finding it and connecting (they hold the lock then) and none is
    waiting to be accepted. It removes its socket then, keeping the lock until it exits, so the
    next test process to need one starts a new server."""
    try:
        lock = os.open(control + ".lock", os.O_RDWR)
    except FileNotFoundError:  # the run is over: its folder is gone
        return True
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return False
    if select.select([listener], [], [], 0)[0]:
        os.close(lock)  # (closing the file releases the lock)
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(control)
    return True  # the lock is released when the process exits


class _Client:
    """One test process connected to the server: its requests come in and its replies go out on
    its connection."""

    def __init__(self, connection: socket.socket, number: int):
        self.connection, self.number, self.pending = connection, number, b""

    def read(self) -> list[dict] | None:
        """The requests it sent that are complete; None once it has ended."""
        try:
            chunk = self.connection.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            return None
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        return [json.loads(line) for line in lines]

    def reply(self, message: dict) -> None:
        with contextlib.suppress(OSError):  # a test process that ended takes no replies
            self.connection.sendall(json.dumps(message).encode() + b"\n")


def _received(client: socket.socket) -> bool:
    """Whether the client sent anything: it sends nothing after its request, so a readable
    connection that gives no byte (or a reset) is a client that ended."""
    try:
        return bool(client.recv(1))
    except OSError:
        return False


class _Ranks:
    """The server's side of tests/forkrank.py: a Unix socket where each connection asks for one
    rank, with the client's standard streams passed along."""

    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.clients: dict[int, socket.socket] = {}  # pid -> its client's connection
        self.askers: dict[int, int | None] = {}  # pid -> the test process that ran torchrun

    def waiting(self) -> list:
        return [self.listener, *self.clients.values()]

    def pids(self) -> list[int]:
        return list(self.clients)

    def serve(self, readable: list) -> None:
        if self.listener in readable:
            client = self.listener.accept()[0]
            try:
                self._start(client)
            except (OSError, ValueError):  # a client that died before asking: nothing to run
                client.close()
        for pid, client in list(self.clients.items()):
            if client in readable and not _received(client):  # the client died: so its rank
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        path = self.listener.getsockname()  # (a closed socket has no name)
        self.listener.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(os.path.dirname(path))  # the server's own folder (tempfile.mkdtemp)

    def _start(self, client: socket.socket) -> None:
        client.settimeout(30)
        _, fds, _, _ = socket.recv_fds(client, 1, 3)
        request = json.loads(client.makefile("rb").readline())
        pid = os.fork()
        if pid == 0:
            _child({**request, "fds": fds})  # never returns
        for fd in fds:
            os.close(fd)
        client.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        self.clients[pid] = client
        self.askers[pid] = request.get("client")

    def ended(self, pid: int, exit_code: int) -> int | None:
        """Tells a rank's client that it ended; the number of the test process that ran its
        torchrun (None for another child, or a rank of no known test)."""
        client = self.clients.pop(pid, None)
        if client is None:
            return None
        with contextlib.suppress(OSError):
            client.sendall(json.dumps({"exit": exit_code}).encode() + b"\n")
        client.close()
        return self.askers.pop(pid, None)


def _reply(out, message: dict) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def _child(request: dict) -> None:
    """In the forked child: become the command, run it, end as Python would."""
    code = 1
    try:
        _fresh_signals()
        if request.get("new_group"):
            os.setsid()
        if "fds" in request:  # a rank: the client's own streams
            stdin, stdout, stderr = request["fds"]
        else:
            stdin = os.open(request["stdin"] or os.devnull, os.O_RDONLY)
            stdout = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
            stderr = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        unbuffered = request["env"].get("PYTHONUNBUFFERED", "") not in ("", "0")
        sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = open(  # noqa: SIM115
                fd, "w", closefd=False, buffering=1, errors="backslashreplace"
            )
            if unbuffered or fd == 2:
                stream.reconfigure(write_through=True)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        code = _run(request["argv"])
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        _end()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as Python ends on an uncaught Ctrl-C
    except BaseException as error:  # noqa: BLE001 - handled as the interpreter would
        code = _uncaught(error)
    _end()
    os._exit(code)


def _fresh_signals() -> None:
    """The signals as a process started from a shell has them: none blocked, Ctrl-C raising
    KeyboardInterrupt, SIGTERM and SIGHUP ending it. The server inherits its signal mask and
    ignored signals from the test worker that started it (both survive exec): a server started
    while the worker had SIGINT blocked gave every child a Ctrl-C that never arrived, and a run
    meant to stop at it trained to the end (test_signal_seams, now and then under xdist)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def _run(argv: list[str]) -> int:
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
    return 0


def _uncaught(error: BaseException) -> int:
    """What the interpreter does with an uncaught exception: `sys.excepthook` shows it (the one
    importing steadytrain installs prints a refusal's message), exit 1; a hook that raises
    `SystemExit` ends the process with that code instead."""
    try:
        sys.excepthook(type(error), error, error.__traceback__)
    except SystemExit as stop:
        return _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - a broken hook: the interpreter prints both
        import traceback

        traceback.print_exc()
    return 1


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _end() -> None:
    """What the interpreter does on its way out: join non-daemon threads, run atexit."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


# -- the client (in the test process) -------------------------------------------------------------


class Forked:
    """A child the server forked: `subprocess.Popen`'s pid, poll, wait, signals and returncode;
    its output is in files, read with `output()`."""

    def __init__(self, server: _Server, ident: int, folder: Path, args: list[str]):
        self.server, self.id, self.folder, self.args = server, ident, folder, args
        self.pid = server.wait_for(ident, "pid")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.result(self.id)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.wait_for(self.id, "exit", timeout, self.args)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        return tuple(
            (self.folder / name).read_text(errors="backslashreplace")
            for name in ("stdout", "stderr")
        )


class _Server:
    """The test process's connection to the server for one value of the start-up settings: the
    one this run's test processes share (found by its socket under the lock), started by the
    first that needs it."""

    def __init__(self, env: dict[str, str]):
        key = tuple(sorted((k, v) for k, v in env.items() if AT_START.match(k)))
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        control = os.path.join(_shared_folder(), name)
        lock = os.open(control + ".lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.connection = _connect(control)
            if self.connection is None:
                _start_server(env, key, control)
                self.connection = _connect(control)
            if self.connection is None:
                raise RuntimeError("forkserver did not start")
            hello = json.loads(self.connection.makefile("rb").readline())
        finally:
            os.close(lock)  # (closing the file releases the lock)
        self.number, self.socket = hello["hello"], hello["ranks"]
        self.lock = threading.Condition()
        self.replies: dict[tuple[int, str], int] = {}
        self.ids = itertools.count()
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="forkserver-replies").start()

    def _read(self) -> None:
        global forked_cpu
        for line in self.connection.makefile("rb"):
            message = json.loads(line)
            if "hello" in message:
                continue
            with self.lock:
                kind = "pid" if "pid" in message else "exit"
                self.replies[(message["id"], kind)] = message[kind]
                forked_cpu += message.get("cpu", 0.0)
                self.lock.notify_all()
        with self.lock:
            self.dead = True
            self.lock.notify_all()

    def send(self, request: dict) -> int:
        ident = next(self.ids)
        with self.lock:
            self.connection.sendall(json.dumps({**request, "id": ident}).encode() + b"\n")
        return ident

    def result(self, ident: int) -> int | None:
        with self.lock:
            return self.replies.get((ident, "exit"))

    def wait_for(self, ident: int, kind: str, timeout: float | None = None, args=None) -> int:
        with self.lock:
            ok = self.lock.wait_for(lambda: (ident, kind) in self.replies or self.dead, timeout)
            if not ok:
                raise subprocess.TimeoutExpired(args or [], timeout)
            if (ident, kind) not in self.replies:
                raise RuntimeError("forkserver ended")
            return self.replies[(ident, kind)]


def _shared_folder(make: bool = True) -> str:
    """Where this run's servers listen: one folder per pytest run, named by the process that
    runs the session (an xdist worker's parent), so the run's workers share each server.
    tests/conftest.py removes it when the run ends."""
    session = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    folder = os.path.join(tempfile.gettempdir(), f"stfs-{os.getuid()}-{session}")
    if make:
        os.makedirs(folder, exist_ok=True)
    return folder


def remove_shared_folder() -> None:
    """At the end of the run (its servers end as their workers do)."""
    shutil.rmtree(_shared_folder(make=False), ignore_errors=True)


def _connect(control: str) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(control)
    except (FileNotFoundError, ConnectionRefusedError):
        connection.close()
        return None
    return connection


def _start_server(env: dict[str, str], key: tuple, control: str) -> None:
    """Start a server for these start-up settings and wait until it listens on `control`. It
    ends when no test process is connected any more, not when this one ends: the process started
    here forks it and ends, so that no worker has a child that outlives it."""
    base = {k: v for k, v in os.environ.items() if not AT_START.match(k)}
    ranks = os.path.join(tempfile.mkdtemp(prefix="fs-"), "ranks")
    proc = subprocess.Popen(
        [sys.executable, __file__],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        env={**base, **dict(key), SOCKET: ranks, CONTROL: control},
        cwd=Path(__file__).parent,
    )
    ready = proc.stdout.readline()
    proc.stdout.close()
    proc.wait()
    if not ready:
        raise RuntimeError("forkserver did not start")


_servers: dict[tuple, _Server] = {}
forked_cpu = 0.0
"""CPU seconds of the children forked so far, as `getrusage(RUSAGE_CHILDREN)` would count them
had the test process started them itself (tests/conftest.py adds it to a test's cost)."""
_servers_lock = threading.Lock()


def _python_command(argv: list[str]) -> list[str] | None:
    """The part after the interpreter, when argv is `python SCRIPT ...` or `python -m MOD ...`."""
    if not argv or argv[0] != sys.executable or len(argv) < 2:
        return None
    rest = list(argv[1:])
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if rest and rest[0] == "-m" and len(rest) >= 2:
        return rest
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return rest
    return None


ENABLED = os.environ.get("STEADYTRAIN_TEST_FORK", "1") != "0"


def _server(env: dict[str, str]) -> _Server:
    """The server for this environment's start-up settings (found or started on first use)."""
    key = tuple(sorted((k, v) for k, v in env.items() if AT_START.match(k)))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.dead:
            server = _servers[key] = _Server(env)
        return server


def torchrun_command(
    script: Path,
    *args: str,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    fork_ranks: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """`torchrun --nproc_per_node NPROC SCRIPT ARGS` on a free port, with its ranks forked from
    the server for `env` (tests/forkrank.py before the script); returns the command and the
    environment to run it with (`env` plus the server's socket).

    fork_ranks=False where `steadytrain run` supervises torchrun: the supervisor knows its
    child's processes by their process group, which a rank forked by the server is not in."""
    env = dict(os.environ if env is None else env)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    if not (ENABLED and fork_ranks):
        return [*launch, str(script), *args], env
    server = _server(env)
    env[SOCKET], env[CLIENT] = server.socket, str(server.number)
    return [*launch, str(Path(__file__).with_name("forkrank.py")), str(script), *args], env


def start(
    argv: list[str],
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin: str | Path | None = None,
    new_group: bool = False,
):
    """Start `argv` as a forked child where it can be one, else as a plain subprocess (with
    stdout and stderr in files either way). Returns a handle with Popen's methods and
    `output()`."""
    env = dict(os.environ if env is None else env)
    command = _python_command(argv)
    if command is None or not ENABLED:
        return _Plain(argv, env, cwd, stdin, new_group)
    server = _server(env)
    folder = Path(tempfile.mkdtemp(prefix="forked-"))
    for name in ("stdout", "stderr"):
        (folder / name).touch()
    request = {
        "argv": command,
        "env": env,
        "cwd": str(cwd or os.getcwd()),
        "stdin": str(stdin) if stdin else None,
        "stdout": str(folder / "stdout"),
        "stderr": str(folder / "stderr"),
        "new_group": new_group,
    }
    return Forked(server, server.send(request), folder, argv)


class _Plain:
    """The same handle over a plain subprocess, for commands the server cannot run."""

    def __init__(self, argv, env, cwd, stdin, new_group):
        self.folder = Path(tempfile.mkdtemp(prefix="spawned-"))
        self.args = argv
        with (
            open(self.folder / "stdout", "w") as out,
            open(self.folder / "stderr", "w") as err,
            open(stdin or os.devnull) as inp,
        ):
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=inp,
                stdout=out,
                stderr=err,
                start_new_session=new_group,
            )
        self.pid = self.proc.pid

    def __getattr__(self, name):
        return getattr(self.proc, name)

    def output(self) -> tuple[str, str]:
        return tuple(
            (self.folder / name).read_text(errors="backslashreplace")
            for name in ("stdout", "stderr")
        )


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, ...)` through `start`."""
    stdin = None
    if input is not None:
        handle, stdin = tempfile.mkstemp(prefix="stdin-")
        with os.fdopen(handle, "w") as out:
            out.write(input)
    child = start(argv, env=env, cwd=cwd, stdin=stdin)
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise
    stdout, stderr = child.output()
    shutil.rmtree(child.folder, ignore_errors=True)
    if stdin is not None:
        os.unlink(stdin)
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


if __name__ == "__main__":
    _serve()
    os._exit(0)  # its children are gone: no need to unload torch and the rest on the way out
