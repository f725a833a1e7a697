#!/usr/bin/env python3
"""Writes the seed corpora of the fuzzers (tests/fuzz/corpus/{command,ring}/seed-*): valid
command sequences and ring programs that reach deep paths, for the fuzzer to mutate.
Layouts follow src/proto/command.h and src/proto/ring.h (little-endian). Re-run after a change
to those formats: python3 tests/fuzz/make_seeds.py"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
NONE = 0xFFFFFFFF

# ---- command fuzzer: records of [flags u8][len u16][message]; flags 1 = repair the header,
# 2 = size the body for its opcode, 4 = attach a sealed memfd.
OPS = dict(hello=1, alloc_pd=2, dealloc_pd=3, reg_segment=4, reg_mr=5, dereg_mr=6,
           create_channel=7, destroy_channel=8, create_cq=9, destroy_cq=10, create_qp=11,
           modify_qp=12, query_qp=13, destroy_qp=14, status=15, create_srq=16, modify_srq=17,
           query_srq=18, destroy_srq=19, cm_create_channel=35, cm_destroy_channel=36,
           cm_create_id=37, cm_destroy_id=38, cm_bind=39, cm_listen=40, cm_resolve_addr=41,
           cm_resolve_route=42, cm_connect=43, cm_accept=44, cm_reject=45, cm_establish=46,
           cm_disconnect=47, cm_migrate_id=48, rereg_mr=54, resize_cq=55, alloc_dm=56, free_dm=57,
           reg_dm_mr=58, alloc_mw=59, dealloc_mw=60, mw_view=62, dereg_segment=34, open_xrcd=68,
           close_xrcd=69, create_xrc_srq=70, open_qp=71)


def msg(op, body=b"", flags=3):
    m = struct.pack("<IHHIIiI", 0x4D445256, 1, OPS[op], 24 + len(body), 1, 0, 0) + body
    return struct.pack("<BH", flags, len(m)) + m


def qp_attr(state, port=1, access=7, dlid=0, dqpn=0, **kw):
    a = bytearray(76)
    struct.pack_into("<IIIIIIII", a, 0, state, 0, 5, access, 0, 0, 0, dqpn)
    struct.pack_into("<HBBBBBBB", a, 32, 0, port, kw.get("rd", 1), kw.get("drd", 1), 12, 14, 7, 7)
    struct.pack_into("<H", a, 44, dlid)
    return bytes(a)


hello = msg("hello", b"seed-guest".ljust(64, b"\0") + struct.pack("<II", 1234, 0))


def cm_addr(port, ip=b"\x7f\0\0\x01"):  # AF_INET
    return struct.pack("<HHI", 2, port, 0) + ip.ljust(16, b"\0")


def cm_conn(id_, qpn):  # CmConnReq: id, private_len, CmQpInfo, private data
    qp = struct.pack("<II16sHBBBBBBBBHI", qpn, 5, b"\xfe\x80".ljust(16, b"\0"), 7, 2, 1, 1, 0,
                     7, 7, 0, 3, 0, 0)
    return struct.pack("<II", id_, 2) + qp + b"hi".ljust(224, b"\0")


def h(x):
    return struct.pack("<II", x, 0)


# Channel 1; listener id 2 on 127.0.0.1:7000; requester id 3; the request's id 4.
cm = b"".join([
    hello,
    msg("cm_create_channel"),
    msg("cm_create_id", struct.pack("<IHBB", 1, 0x106, 2, 0)),
    msg("cm_bind", h(2) + cm_addr(7000)),
    msg("cm_listen", h(2)),
    msg("cm_create_id", struct.pack("<IHBB", 1, 0x106, 2, 0)),
    msg("cm_resolve_addr", h(3) + cm_addr(0, b"") + cm_addr(7000)),
    msg("cm_resolve_route", h(3) + cm_addr(0, b"") + cm_addr(0, b"")),
    msg("cm_connect", cm_conn(3, 0x12)),
    msg("cm_accept", cm_conn(4, 0x13)),
    msg("cm_establish", h(3)),
    msg("cm_disconnect", h(3)),
    msg("cm_disconnect", h(4)),
    msg("cm_destroy_id", h(4)),
    msg("cm_migrate_id", struct.pack("<II", 3, 1)),
    msg("cm_destroy_id", h(3)),
    msg("cm_destroy_channel", h(1)),
])
lifecycle = b"".join([
    hello,
    msg("alloc_pd"),                                                     # pd 1
    msg("create_cq", struct.pack("<IIII", 16, NONE, 0, 0)),              # cq 2
    msg("reg_segment", struct.pack("<Q", 8192), flags=7),                # segment 3
    msg("reg_mr", struct.pack("<IIQQQII", 1, 7, 0x10000, 8192, 0x10000, 2, 0) +
        struct.pack("<QQQII", 0, 4096, 0, 3, 0) + struct.pack("<QQQII", 4096, 4096, 4096, 3, 0)),
    msg("create_qp", struct.pack("<IIIIBBHI", 1, 2, 2, NONE, 2, 0, 0, 0) +
        struct.pack("<IIIIII", 8, 8, 2, 2, 64, 0)),                       # qp 5
    msg("modify_qp", struct.pack("<II", 5, 1 | 8 | 16 | 32) + qp_attr(1)),
    msg("modify_qp", struct.pack("<II", 5, 1 | 128 | 256 | 1024 | 2048 | 4096 | 65536 | 131072 | 1048576) +
        qp_attr(2, dlid=1, dqpn=0x11)),
    msg("query_qp", struct.pack("<II", 5, 0)),
    msg("mw_view", struct.pack("<IIII", 5, 0x400, 0, 0)),                 # no window there
    msg("mw_view", struct.pack("<IIII", 5, 0x400, 1, 0)),
    msg("create_channel"),
    msg("create_srq", struct.pack("<II", 1, 0) + struct.pack("<IIII", 8, 2, 4, 0)),
    msg("modify_srq", struct.pack("<II", 8, 2) + struct.pack("<IIII", 8, 2, 2, 0)),
    msg("status", b"\0" * 8),
    msg("destroy_qp", struct.pack("<II", 5, 0)),
    msg("dereg_mr", struct.pack("<II", 4, 0)),
    msg("destroy_cq", struct.pack("<II", 2, 0)),
    msg("dealloc_pd", struct.pack("<II", 1, 0)),
])
# Issue 24: rereg_mr (every flag), resize_cq around held completions, device memory.
more_verbs = b"".join([
    hello,
    msg("alloc_pd"),                                                     # pd 1
    msg("alloc_pd"),                                                     # pd 2
    msg("create_cq", struct.pack("<IIII", 16, NONE, 0, 0)),              # cq 3
    msg("resize_cq", struct.pack("<II", 3, 100)),
    msg("resize_cq", struct.pack("<II", 3, 4)),
    msg("reg_segment", struct.pack("<Q", 8192), flags=7),                # segment 4
    msg("reg_mr", struct.pack("<IIQQQII", 1, 7, 0x10000, 4096, 0x10000, 1, 0) +
        struct.pack("<QQQII", 0, 4096, 0, 4, 0)),                         # mr 5
    msg("rereg_mr", struct.pack("<II", 5, 7) +
        struct.pack("<IIQQQII", 2, 1, 0x20000, 8192, 0x20000, 1, 0) + struct.pack("<QQQII", 0, 8192, 0, 4, 0)),
    msg("alloc_dm", struct.pack("<QII", 5000, 3, 0), flags=3),           # dm 7 (segment 6)
    msg("reg_dm_mr", struct.pack("<IIIIQQ", 1, 7, 0x20 | 7, 0, 0, 4096)),  # mr 8
    msg("free_dm", struct.pack("<II", 7, 0)),
    msg("dereg_segment", struct.pack("<II", 6, 0)),
    msg("dereg_mr", struct.pack("<II", 8, 0)),
    msg("free_dm", struct.pack("<II", 7, 0)),
    msg("dereg_mr", struct.pack("<II", 5, 0)),
    msg("destroy_cq", struct.pack("<II", 3, 0)),
])
# On-demand paging: an ODP MR (no extents) and an implicit one; pages added with kReregOdpMap
# (twice, overlapping, and outside the MR), a plain rereg refused, an ODP MR with extents refused.
ODP_MAP = 1 << 31
odp = b"".join([
    hello,
    msg("alloc_pd"),                                                     # pd 1
    msg("reg_segment", struct.pack("<Q", 8192), flags=7),                # segment 2
    msg("reg_mr", struct.pack("<IIQQQII", 1, 0x47, 0x10000, 65536, 0x10000, 0, 0)),  # mr 3
    msg("reg_mr", struct.pack("<IIQQQII", 1, 0x41, 0, 2**64 - 1, 0, 0, 0)),          # mr 4
    msg("reg_mr", struct.pack("<IIQQQII", 1, 0x41, 0x10000, 4096, 0x10000, 1, 0) +
        struct.pack("<QQQII", 0, 4096, 0, 2, 0)),
    msg("rereg_mr", struct.pack("<II", 3, ODP_MAP) +
        struct.pack("<IIQQQII", 1, 0x47, 0x11000, 4096, 0x11000, 1, 0) + struct.pack("<QQQII", 0, 4096, 4096, 2, 0)),
    msg("rereg_mr", struct.pack("<II", 3, ODP_MAP) +
        struct.pack("<IIQQQII", 1, 0x47, 0x10000, 8192, 0x10000, 1, 0) + struct.pack("<QQQII", 0, 8192, 0, 2, 0)),
    msg("rereg_mr", struct.pack("<II", 3, ODP_MAP) +
        struct.pack("<IIQQQII", 1, 0x47, 0x30000, 4096, 0x30000, 1, 0) + struct.pack("<QQQII", 0, 4096, 0, 2, 0)),
    msg("rereg_mr", struct.pack("<II", 4, 4) + struct.pack("<IIQQQII", 1, 7, 0, 0, 0, 0, 0)),
    msg("dereg_segment", struct.pack("<II", 2, 0)),
    msg("dereg_mr", struct.pack("<II", 3, 0)),
    msg("dereg_mr", struct.pack("<II", 4, 0)),
    msg("dereg_segment", struct.pack("<II", 2, 0)),
])
# Memory windows: allocated in a PD (which then cannot go), a bad PD and type, freed twice.
windows = b"".join([
    hello,
    msg("alloc_pd"),                                                     # pd 1
    msg("alloc_mw", struct.pack("<II", 1, 1)),                           # mw 2 (type 1)
    msg("alloc_mw", struct.pack("<II", 1, 2)),                           # mw 3 (type 2)
    msg("alloc_mw", struct.pack("<II", 9, 1)),
    msg("alloc_mw", struct.pack("<II", 1, 3)),
    msg("dealloc_pd", struct.pack("<II", 1, 0)),
    msg("mw_view", struct.pack("<IIII", 9, 0x200, 0, 0)),                 # no such QP
    msg("mw_view", struct.pack("<IIII", 9, 0x200, 1, 0)),
    msg("mw_view", struct.pack("<IIII", 9, 0x200, 6, 0)),                 # unknown flags
    msg("dealloc_mw", struct.pack("<II", 2, 0)),
    msg("dealloc_mw", struct.pack("<II", 3, 0)),
    msg("dealloc_mw", struct.pack("<II", 3, 0)),
])
# XRC: a private domain (no fd attached: O_CREAT), an XRC SRQ with its CQ, a receive QP of the
# domain taken to RTR, opened again by number, a close refused while they are in it.
xrc = b"".join([
    hello,
    msg("alloc_pd"),                                                     # pd 1
    msg("create_cq", struct.pack("<IIII", 16, NONE, 0, 0)),              # cq 2
    msg("open_xrcd", struct.pack("<II", 0o100, 0)),                      # xrcd 3
    msg("open_xrcd", struct.pack("<II", 0, 0)),
    msg("create_xrc_srq", struct.pack("<IIII", 1, 3, 2, 0) + struct.pack("<IIII", 8, 1, 0, 0)),
    msg("create_qp", struct.pack("<IIIIBBHI", NONE, NONE, NONE, NONE, 10, 0, 0, 3) +
        struct.pack("<IIIIII", 0, 0, 0, 0, 0, 0)),                        # qp 5 (XRC_RECV)
    msg("modify_qp", struct.pack("<II", 5, 1 | 8 | 16 | 32) + qp_attr(1)),
    msg("modify_qp", struct.pack("<II", 5, 1 | 128 | 256 | 1024 | 2048 | 65536 | 131072 | 1048576) +
        qp_attr(2, dlid=1, dqpn=0x12)),
    msg("open_qp", struct.pack("<IIII", 3, 0x11, 10, 0)),                 # qp 6
    msg("close_xrcd", struct.pack("<II", 3, 0)),
    msg("create_qp", struct.pack("<IIIIBBHI", 1, 2, 2, NONE, 9, 0, 0, 0) +
        struct.pack("<IIIIII", 8, 0, 1, 0, 0, 0)),                        # qp 7 (XRC_SEND)
    msg("destroy_qp", struct.pack("<II", 6, 0)),
    msg("destroy_qp", struct.pack("<II", 5, 0)),
    msg("destroy_srq", struct.pack("<II", 4, 0)),
    msg("close_xrcd", struct.pack("<II", 3, 0)),
])
command = {
    "seed-xrc": xrc,
    "seed-windows": windows,
    "seed-more-verbs": more_verbs,
    "seed-odp": odp,
    "seed-lifecycle": lifecycle,
    "seed-cm": cm,
    "seed-before-hello": msg("alloc_pd") + hello + hello,
    "seed-raw-garbage": struct.pack("<BH", 0, 8) + b"VRDM\x01\x00\x02\x00",
    "seed-quota": hello + msg("alloc_pd") + msg("create_cq", struct.pack("<IIII", 4, NONE, 0, 0)) * 6,
}

# ---- ring fuzzer: see fuzz_ring.cc (World::run) for the operations.
SEND, WRITE, WRITE_IMM, SEND_IMM, READ, CAS, FADD = 2, 0, 1, 3, 4, 5, 6
LOCAL_INV, BIND_MW, SEND_INV = 7, 8, 9


def send_wqe(opcode, num_sge=1, flags=2, wr_id=1, inline_len=0):
    w = bytearray(320)
    struct.pack_into("<QIIII", w, 0, wr_id, opcode, flags, 0, num_sge)
    struct.pack_into("<I", w, 36, inline_len)
    return bytes(w)


def aim(sel, off, length):
    return struct.pack("<BHH", sel, off & 0xFFFF, length)


def op_send(qp, slot, wqe, how=0x80, sges=(aim(0, 0, 64), aim(0, 0, 0)), roff=None):
    out = struct.pack("<BBB", 0, qp, slot) + wqe + struct.pack("<B", how)
    if how & 0x80:
        out += b"".join(sges)
        if how & 1:
            out += struct.pack("<H", roff or 0)
    return out


def op_recv(qp, slot, num_sge=1, sel=4, length=256):
    w = bytearray(272)
    struct.pack_into("<QI", w, 0, 7, num_sge)
    return struct.pack("<BBB", 1, qp, slot) + bytes(w) + struct.pack("<B", 0x80) + aim(sel, 0, length) + aim(sel, 0, 0)


def prod(kind, qp, n=1):  # kind 2: SQ, 3: RQ; producer = consumer + n
    return struct.pack("<BBBI", kind, qp, 0, n)


def poll(us=1000):
    return struct.pack("<BBI", 5, 0, us)


ring = {
    "seed-rc-send": op_recv(1, 0) + prod(3, 1) + op_send(0, 0, send_wqe(SEND)) + prod(2, 0) + poll(),
    "seed-rc-write-read": op_send(0, 0, send_wqe(WRITE), how=0x83, roff=128) +
        op_send(0, 1, send_wqe(READ), how=0x83, roff=256) + prod(2, 0, 2) + poll(),
    "seed-atomic-straddle": op_send(0, 0, send_wqe(FADD), how=0x8B, sges=(aim(0, 0, 8), aim(0, 0, 0)),
                                    roff=4088) + prod(2, 0) + poll(),
    "seed-ud": op_recv(3, 0) + prod(3, 3) + op_send(2, 0, send_wqe(SEND), how=0xB0) + prod(2, 2) + poll(),
    "seed-srq-uc": op_recv(5, 0x80) + struct.pack("<BBBI", 4, 5, 1, 1) +
        op_send(4, 0, send_wqe(SEND)) + prod(2, 4) + poll(),
    "seed-mw-ops": op_send(0, 0, send_wqe(BIND_MW, num_sge=0), how=0) +
        op_send(0, 1, send_wqe(LOCAL_INV, num_sge=0), how=0) + op_send(0, 2, send_wqe(SEND_INV)) +
        prod(2, 0, 3) + poll(),
    "seed-corrupt-and-die": struct.pack("<BBBI", 2, 0, 1, 0xFFFFFFFF) + poll() +
        op_send(1, 0, send_wqe(SEND)) + prod(2, 1) + struct.pack("<BBB", 8, 0, 0) + poll(),
}

# ---- wire fuzzer: a stream of frames as a peer backend sends them (src/proto/wire.h).
WIRE_VERSION = 8  # kWireVersion


def frame(t, body, payload=b""):
    return struct.pack("<IHHII", 0x57445256, WIRE_VERSION, t, len(body), len(payload)) + body + payload


hello_f = frame(1, b"node-b".ljust(64, b"\0") + struct.pack("<II", WIRE_VERSION, 0))
guest_up = frame(2, b"tenant".ljust(64, b"\0") + bytes(16) + struct.pack("<HHI", 3, 0, 0))


def request(op, length, payload=b"", qp_type=2, xrc_srqn=0):
    body = bytes(16) + bytes(16) + struct.pack("<HHBBBBIIIIIIII", 3, 4, 0, qp_type, 0, 0, 0x11, 0x12,
                                               7, op, 0, 0, 0x1234, xrc_srqn)
    body += struct.pack("<QQQII", 0x1000, 1, 0, length, 0)
    return frame(4, body, payload)


def reply(syndrome, payload=b""):
    body = bytes(16) + struct.pack("<IIIBBHIIQ", 0x11, 0x12, 7, syndrome, 0, 0, 0, 0, 0)
    return frame(5, body, payload)


def direct_offer(src_qpn, dst_qpn, port, is_global=0):
    body = bytes(16) + bytes(16) + struct.pack("<HHBBHII", 3, 4, is_global, 0, port, src_qpn, dst_qpn)
    return frame(6, body + bytes(range(16)))


def cm_addr(port, last):
    return struct.pack("<HHI", 2, port, 0) + bytes([10, 77, 0, last]) + bytes(12)


def cm(kind, src_id, dst_id, status=0, pdata=b"", ps=0x0106, qp_type=2):
    body = struct.pack("<BBHIIiII", kind, qp_type, ps, src_id, dst_id, status, len(pdata), 0)
    body += cm_addr(40000, 2) + cm_addr(7174, 1)
    body += struct.pack("<II", 0x12, 7) + bytes(16) + struct.pack("<HBBBBBBBBHI", 3, qp_type,
                                                                   1, 1, 1, 7, 7, 0, 5, 0, 0)
    return frame(7, body + pdata.ljust(224, b"\0"))


wire = {
    "seed-hello-guest": hello_f + guest_up + frame(3, guest_up[16:]),
    "seed-requests": hello_f + request(SEND, 16, b"x" * 16) + request(WRITE, 8, b"y" * 8) +
        request(READ, 64) + request(FADD, 8) + request(SEND, 4, b"abcd", qp_type=4),
    "seed-xrc-requests": hello_f + request(SEND, 8, b"x" * 8, qp_type=9, xrc_srqn=1) +
        request(WRITE, 8, b"y" * 8, qp_type=9, xrc_srqn=0xffffff),
    "seed-replies": hello_f + reply(0) + reply(1) + reply(2) + reply(3, b"z" * 32) + reply(4) +
        reply(5),
    "seed-direct-offers": hello_f + direct_offer(0x12, 0x11, 40000) +
        direct_offer(0xffffff, 0x11, 1, is_global=1),
    "seed-cm": hello_f + cm(1, 5, 0, pdata=b"req") + cm(2, 9, 5, pdata=b"rep") + cm(5, 5, 9) +
        cm(6, 9, 5) + cm(4, 5, 9, status=28, pdata=b"rej") + cm(7, 5, 9) +
        cm(3, 9, 5, qp_type=4),
    "seed-close": hello_f + frame(9, bytes(8)) + frame(9, bytes([1]) + bytes(7)) +
        frame(9, bytes([2]) + bytes(7)),
}

# ---- direct_wire fuzzer: what a peer library sends (src/proto/direct_wire.h): a Hello, then
# 64-byte frames, data after those that carry some.
DIRECT_MAGIC, DIRECT_VERSION = 0x44524456, 5  # kDirectMagic, kDirectVersion


def dframe(t, length=0, status=0, flags=0, data=b""):
    return struct.pack("<BBHIIIQQQQ", t, status, flags, 0, length, 0x1234, 0x1000, 1, 0, 0) + \
        bytes(16) + data


dhello = struct.pack("<IIIIII", DIRECT_MAGIC, DIRECT_VERSION, 0x11, 0x12, 3, 1)
direct_wire = {
    "seed-requests": dhello + dframe(1, 8, data=b"s" * 8) + dframe(3, 4, data=b"wwww") +
        dframe(5, 64) + dframe(6, 8) + dframe(7, 8) + dframe(8) + dframe(2, 1, flags=1, data=b"i") +
        dframe(9, 4, data=b"vvvv"),
    "seed-responses": dhello + dframe(16) + dframe(17, status=10) + dframe(18, 4) + dframe(19) +
        dframe(20) + dframe(21) + dframe(24),
}

for name, files in (("command", command), ("ring", ring), ("wire", wire),
                    ("direct_wire", direct_wire)):
    d = os.path.join(HERE, "corpus", name)
    os.makedirs(d, exist_ok=True)
    for f, data in files.items():
        with open(os.path.join(d, f), "wb") as fh:
            fh.write(data)
