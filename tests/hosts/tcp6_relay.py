#!/usr/bin/env python3
"""Relays TCP connections from [::]:PORT (IPv6 only) to 127.0.0.1:PORT.

ibv_rc_pingpong's server binds the first address getaddrinfo gives for "any", 0.0.0.0, which a
client on a host with only IPv6 cannot reach: this carries its exchange of QP numbers (the
application's own TCP, not vrdma's): one connection, then it exits. Usage: tcp6_relay.py PORT
"""
import socket
import sys
import threading


def pump(src, dst):
    try:
        while True:
            b = src.recv(65536)
            if not b:
                break
            dst.sendall(b)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def main():
    port = int(sys.argv[1])
    ls = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    ls.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("::", port))
    ls.listen(1)
    # One connection (the pingpong's exchange), then gone; gone anyway if none comes.
    ls.settimeout(60)
    c, _ = ls.accept()
    c.settimeout(None)
    u = socket.create_connection(("127.0.0.1", port))
    t = threading.Thread(target=pump, args=(c, u), daemon=True)
    t.start()
    pump(u, c)
    t.join(60)


if __name__ == "__main__":
    main()
