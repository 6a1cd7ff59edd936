"""One torchrun rank, forked from the test's warm server instead of started afresh.

    torchrun ... tests/forkrank.py SCRIPT ARGS      (tests/forkserver.py `torchrun_command`)

torchrun starts this as it would start SCRIPT (`python -u forkrank.py SCRIPT ARGS`). It imports
only the standard library: it passes its standard streams, argv, environment and folder to the
server named by STEADYTRAIN_TEST_FORK_SOCKET, which forks SCRIPT from a process that has torch
and steadytrain imported already. The signals torchrun sends go on to the rank; this process
ends as the rank ended: the same exit code, or killed by the same signal. If this process is
killed, the server kills the rank.
"""

import contextlib
import json
import os
import signal
import socket
import sys


def main() -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(os.environ.pop("STEADYTRAIN_TEST_FORK_SOCKET"))
    client = os.environ.pop("STEADYTRAIN_TEST_FORK_CLIENT", None)  # the test that ran torchrun
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # torchrun starts ranks with `python -u`
    socket.send_fds(server, [b"\0"], [0, 1, 2])
    request = {"argv": sys.argv[1:], "env": env, "cwd": os.getcwd(), "client": client}
    server.sendall(json.dumps(request).encode() + b"\n")
    replies = server.makefile("rb")
    pid = json.loads(replies.readline())["pid"]

    def forward(signum: int, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):  # the rank may have ended already
            os.kill(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(signum, forward)
    line = replies.readline()
    code = json.loads(line)["exit"] if line else -signal.SIGKILL
    if code < 0:
        if -code != signal.SIGKILL:  # (SIGKILL's handler cannot be set; it is the default)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
