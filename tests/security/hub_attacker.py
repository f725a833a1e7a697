#!/usr/bin/env python3
"""A stranger at a library's direct-path port (the hub of src/verbs/remote.cc), for direct_hub.sh.

hello HOST PORT TO_QPN FROM_QPN
    Sends a plain (not TLS) hello of the old protocol (magic, version, the real QPN pair, a
    random token): the hub takes only a TLS handshake, so it must close the connection at once
    without a byte of answer. Prints "closed unanswered".
flood HOST PORT N SECS
    Opens N connections, 10 every 20 ms, and says nothing on them. The hub must close them:
    those over its cap at once, the rest when their hello is late. Prints "established E closed
    C fast F slowest S open O": F closed within 0.5 s of being established, S the longest any
    stayed open, O still open after SECS.
hold HOST PORT N SECS
    Opens N connections (they may wait in the listen queue) and holds them SECS seconds.
"""
import errno
import os
import resource
import selectors
import socket
import struct
import sys
import time

MAGIC, VERSION = 0x44524456, 3  # rwire::kMagic, kVersion


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def hello(host, port, to_qpn, from_qpn):
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(struct.pack("<6I16s", MAGIC, VERSION, from_qpn, to_qpn, 0, 1, os.urandom(16)))
    s.settimeout(1.0)
    try:
        got = s.recv(64)
    except socket.timeout:
        sys.exit("still open 1 s after a wrong token")
    except ConnectionResetError:
        got = b""
    if got:
        sys.exit(f"answered a wrong token: {got!r}")
    print("closed unanswered")


def open_many(host, port, n, sel=None):
    sel = sel or selectors.DefaultSelector()
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            sys.exit(f"connect: {os.strerror(err)}")
        sel.register(s, selectors.EVENT_WRITE, {"up": None})
    return sel


def flood(host, port, n, secs):
    """Opens them BATCH at a time, every PACE s: a client whose connection the kernel could not
    queue for accept (the listen backlog is 64) may believe it is up while the host dropped it
    (a SYN cookie whose ACK found the queue full), which would measure the kernel, not the hub.
    Those are counted as open at the end; the caller checks the hub's side too."""
    BATCH, PACE = 10, 0.02
    raise_nofile()
    sel = selectors.DefaultSelector()
    start = time.monotonic()
    opened = established = closed = fast = 0
    slowest = 0.0
    next_open = start
    while (opened < n or sel.get_map()) and time.monotonic() - start < secs:
        if opened < n and time.monotonic() >= next_open:
            open_many(host, port, min(BATCH, n - opened), sel)
            opened += min(BATCH, n - opened)
            next_open += PACE
        wait = next_open - time.monotonic() if opened < n else 0.1
        for key, _ in sel.select(timeout=max(0.0, min(wait, 0.1))):
            s, st = key.fileobj, key.data
            now = time.monotonic()
            if st["up"] is None:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    sys.exit("a connection failed to establish")
                st["up"] = now
                established += 1
                sel.modify(s, selectors.EVENT_READ, st)
                continue
            try:
                if s.recv(64):
                    sys.exit("the hub said something to a stranger")
            except ConnectionResetError:
                pass
            open_for = now - st["up"]
            slowest = max(slowest, open_for)
            fast += open_for < 0.5
            closed += 1
            sel.unregister(s)
            s.close()
    print(f"established {established} closed {closed} fast {fast} slowest {slowest:.2f} "
          f"open {len(sel.get_map())}")


def hold(host, port, n, secs):
    raise_nofile()
    sel = open_many(host, port, n)
    time.sleep(secs)
    print(f"held {len(sel.get_map())}")


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "hello" and len(args) == 4:
        hello(args[0], int(args[1]), int(args[2], 0), int(args[3], 0))
    elif mode == "flood" and len(args) == 4:
        flood(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif mode == "hold" and len(args) == 4:
        hold(args[0], int(args[1]), int(args[2]), float(args[3]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
