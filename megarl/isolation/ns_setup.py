"""First stage of an isolated command (see __init__.py): mounts, then the endpoint-only network, then exec.

argv[1] is JSON: {"hide": [dirs], "writable": [dirs], "readable": [dirs the command needs, brought back where
the fresh /tmp or /dev/shm would cover them], "scratch_mb": n, "endpoint": [host, port] or null,
"drop_caps": the setpriv argv that runs the forwarder without capabilities};
argv[2:] is what runs next. Any failure exits 125 before the command runs: a command never starts with its
filesystem half read-only or its network half cut.
"""
import ctypes
import fcntl
import json
import os
import socket
import struct
import sys

RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
FLAGS = {"ro": RDONLY, "nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC, "noatime": 1024, "nodiratime": 2048,
         "relatime": 1 << 21, "strictatime": 1 << 24}
CLONE_NEWNET, SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x40000000, 0x8913, 0x8914, 0x1
FAILED = 125
#: MiB of the command's own /dev/shm (Python's multiprocessing needs a little)
SHM_MB = 64
FDS_ENV = "MEGARL_NS_FDS"
libc = ctypes.CDLL(None, use_errno=True)


def fail(what: str) -> None:
    sys.stderr.write(f"megarl isolation: {what}\n")
    os._exit(FAILED)


def _c(text):
    return None if text is None else text.encode()


def mount(src, dst, fs, flags, data=None) -> None:
    if libc.mount(_c(src), _c(dst), _c(fs), ctypes.c_ulong(flags), _c(data)) != 0:
        fail(f"cannot mount {src} on {dst}: {os.strerror(ctypes.get_errno())}")


def mounts():
    """(mount point, its per-mount options) of every mount, as /proc/self/mountinfo lists them."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode("latin-1").decode()  # \040 is a space
            yield point, fields[5].split(",")


def flags_of(opts, readonly: bool) -> int:
    return REMOUNT | BIND | (RDONLY if readonly else 0) | sum(FLAGS.get(o, 0) for o in opts if o != "ro")


SCRATCH = ("/tmp", "/dev/shm")


def _under_scratch(d: str) -> bool:
    return any(d == s or d.startswith(s + "/") for s in SCRATCH)


def _outermost(dirs) -> list:
    """The directories of ``dirs`` that exist and lie in no other one of them."""
    found = sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)})
    return [d for d in found if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in found)]


def set_up_mounts(spec: dict) -> None:
    mount(None, "/", None, REC | PRIVATE)
    # what the command reads under /tmp or /dev/shm (the interpreter, megarl, its working directory) before the
    # fresh tmpfs covers them: brought back read-only
    readable = [(d, os.open(d, os.O_PATH | os.O_DIRECTORY)) for d in _outermost(spec["readable"])
                if _under_scratch(d)]
    keep = [(d, os.open(d, os.O_PATH | os.O_DIRECTORY)) for d in spec["writable"]]
    for point, opts in sorted({(p, tuple(o)) for p, o in mounts()}):
        if "ro" not in opts:  # every mount read-only, its other flags kept (a user namespace may not drop them)
            mount(None, point, None, flags_of(opts, readonly=True))
    for d, size_mb in zip(SCRATCH, (spec["scratch_mb"], SHM_MB)):
        if os.path.isdir(d):
            mount("tmpfs", d, "tmpfs", NOSUID | NODEV, f"size={size_mb}m,mode=1777")
    for d, fd in readable:  # a bind of the directory as it was, read-only like the mount it came from
        os.makedirs(d, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", d, None, BIND)
        os.close(fd)
    for d, fd in keep:  # a bind of the directory as it was (also under the new /tmp), made writable again
        os.makedirs(d, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", d, None, BIND)
        os.close(fd)
        opts = [o for p, o in mounts() if p == d][-1]
        mount(None, d, None, flags_of(opts, readonly=False))
    for d in spec["hide"]:  # last: also where a writable bind brought a hidden directory back into view
        if os.path.isdir(d):
            mount("tmpfs", d, "tmpfs", RDONLY | NOSUID | NODEV | NOEXEC, "size=4k,mode=000")


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def endpoint_only_network(host: str, port: int, drop_caps: list) -> None:
    """Start the forwarder in this (the run's) network namespace, then move to an empty one whose loopback
    listens on ``port``: ns_init.py hands each connection to the forwarder, which joins it to ``host:port``."""
    here = os.path.dirname(os.path.abspath(__file__))
    relay, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        relay.close()
        os.set_inheritable(theirs.fileno(), True)
        try:
            os.execvp(drop_caps[0], [*drop_caps, sys.executable, "-I", "-S", os.path.join(here, "forwarder.py"),
                                str(theirs.fileno()), host, str(port)])
        finally:
            os._exit(FAILED)
    theirs.close()
    if libc.unshare(CLONE_NEWNET) != 0:
        fail(f"cannot make a network namespace: {os.strerror(ctypes.get_errno())}")
    try:
        loopback_up()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
    except OSError as e:
        fail(f"cannot listen on 127.0.0.1:{port} in the command's network namespace: {e}")
    for s in (listener, relay):
        os.set_inheritable(s.fileno(), True)
    os.environ[FDS_ENV] = f"{listener.detach()},{relay.detach()}"


def main() -> None:
    spec = json.loads(sys.argv[1])
    cwd = os.getcwd()
    set_up_mounts(spec)
    try:  # the working directory through the new mounts: the old one would still reach what they cover
        os.chdir(cwd)
    except OSError:
        os.chdir("/")
    if spec.get("endpoint"):
        host, port = spec["endpoint"]
        endpoint_only_network(host, int(port), spec["drop_caps"])
    os.execvp(sys.argv[2], sys.argv[2:])


if __name__ == "__main__":
    main()
