#!/usr/bin/env python3
"""A binary-safe stand-in for `redis-benchmark -c C -P P -n N -r R CMD ARG...`, for
script-cost.sh: redis-benchmark cuts an argument at its first NUL byte, and tollgate's scripts
take one binary argument (MessagePack). C connections each send P commands at a time and wait
for their P replies, N commands in all; `__rand_int__` in an argument becomes a 12-digit random
number below R; an argument written `mp:a,b,...` is sent as those non-negative integers in
MessagePack, each in its smallest encoding (as tollgate_redis::scripts encodes them).

Usage: pipeline.py PORT N C P R CMD ARG...   (exits 1 if any reply is an error)
"""
import random
import selectors
import socket
import struct
import sys


def mp(text):
    out = b''
    for n in (int(x) for x in text.split(',')):
        if n < 0x80:
            out += bytes([n])
        elif n <= 0xff:
            out += bytes([0xcc, n])
        elif n <= 0xffff:
            out += b'\xcd' + struct.pack('>H', n)
        elif n <= 0xffffffff:
            out += b'\xce' + struct.pack('>I', n)
        else:
            out += b'\xcf' + struct.pack('>Q', n)
    return out


def reply(buf, pos, errors):
    """Where the reply at `pos` ends (None when `buf` does not hold all of it); errors are
    appended to `errors`."""
    end = buf.find(b'\r\n', pos)
    if end < 0:
        return None
    line = buf[pos:end]
    if line[:1] == b'*':
        q = end + 2
        for _ in range(max(int(line[1:]), 0)):
            q = reply(buf, q, errors)
            if q is None:
                return None
        return q
    if line[:1] == b'$':
        n = int(line[1:])
        q = end + 2 + (n + 2 if n >= 0 else 0)
        return q if q <= len(buf) else None
    if line[:1] == b'-':
        errors.append(line.decode(errors='replace'))
    return end + 2


def replies(buf):
    """How many complete replies `buf` starts with, where they end, and the errors among
    them."""
    pos, done, errors = 0, 0, []
    while True:
        seen = []
        q = reply(buf, pos, seen)
        if q is None:
            return done, pos, errors
        errors += seen
        pos, done = q, done + 1


def main():
    port, n, c, p, r = (int(x) for x in sys.argv[1:6])
    args = [mp(a[3:]) if a.startswith('mp:') else a.encode() for a in sys.argv[6:]]
    rnd = random.Random(1)

    def command():
        parts = [a.replace(b'__rand_int__', b'%012d' % rnd.randrange(r)) for a in args]
        return b'*%d\r\n' % len(parts) + b''.join(b'$%d\r\n%s\r\n' % (len(x), x) for x in parts)

    sel = selectors.DefaultSelector()
    left, pending, errors = n, {}, []

    def send(s):
        nonlocal left
        k = min(p, left)
        left -= k
        if k:
            s.sendall(b''.join(command() for _ in range(k)))
            pending[s] = [k, b'']
        return k > 0

    for _ in range(c):
        s = socket.create_connection(('127.0.0.1', port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if send(s):
            sel.register(s, selectors.EVENT_READ)
    active = len(pending)
    while active:
        for key, _ in sel.select():
            s = key.fileobj
            st = pending[s]
            st[1] += s.recv(65536)
            done, pos, errs = replies(st[1])
            errors += errs
            st[0] -= done
            st[1] = st[1][pos:]
            if st[0] == 0 and not send(s):
                sel.unregister(s)
                s.close()
                active -= 1
    if errors:
        print(f'{len(errors)} error replies, the first: {errors[0]}', file=sys.stderr)
        sys.exit(1)


main()
