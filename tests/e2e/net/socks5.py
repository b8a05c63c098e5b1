"""A small SOCKS5 proxy (RFC 1928 CONNECT, RFC 1929 username/password) for
the egress proxy tests, run inside the stand-in internet's namespace.
Each CONNECT's target is appended to the log file; prints "ready" once
listening.

Usage: socks5.py --listen ADDR:PORT --log FILE [--user U --password P]
                 [--tls-cert CERT --tls-key KEY]   (SOCKS5 inside TLS)
"""

import argparse
import asyncio
import ipaddress
import socket
import ssl


async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            w.close()
        except Exception:
            pass


async def handle(reader, writer, args):
    try:
        ver, n = await reader.readexactly(2)
        methods = await reader.readexactly(n)
        want = 2 if args.user else 0
        if ver != 5 or want not in methods:
            writer.write(b"\x05\xff")
            return
        writer.write(bytes([5, want]))
        if want == 2:
            _, ulen = await reader.readexactly(2)
            user = (await reader.readexactly(ulen)).decode()
            (plen,) = await reader.readexactly(1)
            password = (await reader.readexactly(plen)).decode()
            ok = user == args.user and password == args.password
            writer.write(b"\x01\x00" if ok else b"\x01\x01")
            if not ok:
                with open(args.log, "a") as log:
                    log.write(f"AUTH-FAILED {user}\n")
                return
        ver, cmd, _, atyp = await reader.readexactly(4)
        if atyp == 1:
            host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
        elif atyp == 3:
            (ln,) = await reader.readexactly(1)
            host = (await reader.readexactly(ln)).decode()
        else:
            writer.write(b"\x05\x08\x00\x01" + bytes(6))
            return
        port = int.from_bytes(await reader.readexactly(2), "big")
        with open(args.log, "a") as log:
            log.write(f"CONNECT {host}:{port}\n")
        try:
            ur, uw = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        except (OSError, asyncio.TimeoutError):
            writer.write(b"\x05\x05\x00\x01" + bytes(6))
            return
        bound = uw.get_extra_info("sockname")
        writer.write(b"\x05\x00\x00\x01" + socket.inet_aton(bound[0]) + bound[1].to_bytes(2, "big"))
        await writer.drain()
        await asyncio.gather(pipe(reader, uw), pipe(ur, writer))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        try:
            writer.close()
        except Exception:
            pass


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--user")
    p.add_argument("--password")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    args = p.parse_args()
    host, port = args.listen.rsplit(":", 1)
    tls = None
    if args.tls_cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    server = await asyncio.start_server(lambda r, w: handle(r, w, args), host, int(port), ssl=tls)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
