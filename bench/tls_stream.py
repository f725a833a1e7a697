#!/usr/bin/env python3
"""One TLS 1.3 stream's throughput through OpenSSL's own record layer (Python's ssl module),
mutually authenticated with a vrdma cluster credential: the TLS peer bench/crosshost_tls.sh
sets beside vrdma's TLS transport (iperf3 is plaintext). The suite comes from OpenSSL's
configuration (the script sets TLS_AES_128_GCM_SHA256, the transport's first choice).

Usage: tls_stream.py server PORT DIR NODE   (prints MB/s received, first byte to EOF)
       tls_stream.py client HOST PORT DIR NODE SECONDS [WRITE_BYTES]
"""
import socket
import ssl
import sys
import time


def context(side, d, node):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if side == "server" else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(f"{d}/{node}.pem", f"{d}/{node}.key")
    ctx.load_verify_locations(f"{d}/ca.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False
    return ctx


def server(port, d, node):
    ls = socket.create_server(("0.0.0.0", int(port)))
    conn, _ = ls.accept()
    s = context("server", d, node).wrap_socket(conn, server_side=True)
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    got, start = 0, None
    while True:
        n = s.recv_into(view)
        if n == 0:
            break
        if start is None:
            start = time.monotonic()
        got += n
    secs = time.monotonic() - start
    print(f"{got / secs / 1e6:.2f} MB/s {s.cipher()[0]}")


def client(host, port, d, node, seconds, size=1 << 20):
    raw = socket.create_connection((host, int(port)))
    s = context("client", d, node).wrap_socket(raw)
    data = memoryview(bytes(int(size)))
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        s.sendall(data)
    try:
        s.unwrap()  # close_notify: the server's EOF
    except OSError:
        pass
    raw.close()


if __name__ == "__main__":
    {"server": server, "client": client}[sys.argv[1]](*sys.argv[2:])
