"""Process 1 of an isolated command's PID namespace (see __init__.py).

The command must not be process 1: the kernel spares process 1 every signal it has no handler for, SIGXCPU and
a self-sent SIGKILL included. This starts the command (argv[1:]), forwards SIGTERM/SIGINT/SIGHUP to it, reaps
orphans, and exits with the command's status, 128 + N for a command killed by signal N. With an endpoint-only
network (``MEGARL_NS_FDS``: the loopback listener and the forwarder's socket, from ns_setup.py) it accepts the
command's connections and hands each to the forwarder; the command inherits neither socket.
"""
import os
import signal
import socket
import sys
import threading

FDS_ENV = "MEGARL_NS_FDS"


def pass_connections(listener: socket.socket, relay: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        try:
            socket.send_fds(relay, [b"c"], [conn.fileno()])
        finally:
            conn.close()


def main() -> None:
    fds = os.environ.pop(FDS_ENV, "")
    sockets = [socket.socket(fileno=int(fd)) for fd in fds.split(",")] if fds else []
    for s in sockets:
        os.set_inheritable(s.fileno(), False)
    try:  # no process of the same user (the command) may trace this one and use its sockets
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    except (OSError, AttributeError):
        pass
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(sys.argv[1], sys.argv[1:])
        except OSError as e:
            sys.stderr.write("cannot run %r: %s\n" % (sys.argv[1], e))
            os._exit(127)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: os.kill(pid, s))
    if sockets:
        threading.Thread(target=pass_connections, args=sockets, daemon=True).start()
    while True:
        done, status = os.wait()
        if done == pid:
            code = os.waitstatus_to_exitcode(status)
            os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
