"""Joins each connection ns_init.py hands it to one address, the agent endpoint (see __init__.py).

argv: the socket it receives connections on (a file descriptor), the endpoint's host and port. It runs in the
run's network namespace without capabilities, not dumpable (the command cannot trace it), and exits when the
socket closes (the namespace's process 1 ended).
"""
import ctypes
import socket
import sys
import threading


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def join(conn: socket.socket, address: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(address, timeout=30)
        upstream.settimeout(None)
    except OSError:
        conn.close()
        return
    back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
    back.start()
    pump(conn, upstream)
    back.join()
    conn.close()
    upstream.close()


def main() -> None:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    relay = socket.socket(fileno=int(sys.argv[1]))
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(sys.argv[2], sys.argv[2])
    address = (host, int(sys.argv[3]))
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(relay, 1, 1)
        except OSError:
            return
        if not fds:
            return
        conn = socket.socket(fileno=fds[0])
        threading.Thread(target=join, args=(conn, address), daemon=True).start()


if __name__ == "__main__":
    main()
