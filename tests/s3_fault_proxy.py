"""A fault-injecting TCP proxy for tests: loopback only, a bounded number of faults.

Sits between Kiln and an S3 server process. Each accepted connection gets the
next mode of a fixed cycle (cut offsets come from a seeded RNG) until
`max_faults` faulty connections were handed out; after that every connection
passes untouched, so any client that retries finishes. Modes:

- 'slow': every chunk (16 KiB) in both directions is delayed by `latency_s`, 5 ms by default. The delay
  exercises no timeout at any value near it (a read waits one chunk's delay), and a server that keeps
  connections alive (SeaweedFS) sends every later request over the slow one: at 50 ms a chunk a 1.7 MB
  object took 5 s, and the store's transfer test 94 s instead of 11 s, with the same faults fired.
- 'reset_before': the client's first bytes are read and dropped, then the
  client connection is reset (RST): the server never sees the request.
- 'reset_after': the request reaches the server, whose answer is dropped and
  the client reset: the server did the work, the client does not know.
- 'truncate': the server's bytes pass until a cut offset into the connection's
  response stream (inside headers or body), then the client is reset.
- 'truncate_request': the client's bytes pass until a cut offset, then both
  sides are reset: the server sees a partial request body.
- '503': the proxy itself answers the connection's first request with 503
  SlowDown (S3's "later", no body for a HEAD) and closes it: the server never
  sees the request. Not in CYCLE; `arm(cycle=("503",))` makes a burst of them.

`fired` counts the faults that actually happened (a cut beyond the bytes the
connection carried did not fire). `access_keys` holds every AWS access key id
that signed a request passing through (from SigV4 `Credential=<id>/...`), so a
test can tell whose credentials a client used.
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import struct
import threading
from collections import Counter

CYCLE = ("truncate", "slow", "reset_after", "truncate", "reset_before", "truncate_request", "truncate", "pass")
_CHUNK = 16 * 1024
_CREDENTIAL = re.compile(rb"Credential=([A-Za-z0-9]{4,128})/")
_SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
              b"<Message>Please reduce your request rate.</Message></Error>")


def _answer_503(request: bytes) -> bytes:
    """An S3 503 SlowDown answer to `request` (headers only for a HEAD), closing the connection."""
    body = b"" if request.startswith(b"HEAD ") else _SLOW_DOWN
    return (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nx-amz-request-id: kiln-fault-proxy\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(_SLOW_DOWN if body else b"")).encode() +
            b"\r\n\r\n" + body)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    """`with FaultProxy(upstream_port) as proxy: ... proxy.endpoint_url ...`."""

    def __init__(self, upstream_port: int, *, seed: int = 0, max_faults: int = 40, cycle=CYCLE,
                 latency_s: float = 0.005):
        self.upstream_port = upstream_port
        self.max_faults = max_faults
        self.cycle = tuple(cycle)
        self.latency_s = latency_s
        self.rng = random.Random(seed)
        self.handed_out = Counter()
        self.fired = Counter()
        self.connections = 0
        self.access_keys: set[str] = set()
        self._faults_given = 0
        self._position = 0
        self._pass_first = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop)
        self._server = fut.result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        async def close():
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()
        try:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def passthrough(self) -> None:
        """From now on, no more faults."""
        self._faults_given = self.max_faults

    def arm(self, *, max_faults: int, cycle=None, pass_first: int = 0) -> None:
        """Hand out `max_faults` more faulty connections (after `pass_first` clean ones), in `cycle`'s order."""
        self.cycle = tuple(cycle or self.cycle)
        self._position = 0
        self._pass_first = pass_first
        self._faults_given = 0
        self.max_faults = max_faults

    # -- per connection ------------------------------------------------------

    def _next_mode(self) -> tuple[str, int]:
        self.connections += 1
        if self._pass_first > 0:
            self._pass_first -= 1
            return "pass", 0
        if self._faults_given >= self.max_faults:
            return "pass", 0
        mode = self.cycle[self._position % len(self.cycle)]
        self._position += 1
        if mode != "pass":
            self._faults_given += 1
        if mode == "truncate_request":  # inside the request line, headers or an upload's body
            cut = self.rng.randint(20, 600_000)
        else:  # inside the first response's headers, or somewhere in a body of up to ~2 MB
            cut = self.rng.randint(1, 400) if self.rng.random() < 0.4 else self.rng.randint(600, 2_000_000)
        self.handed_out[mode] += 1
        return mode, cut

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        mode, cut = self._next_mode()
        if mode == "503":
            try:
                request = await creader.read(_CHUNK)
                self.access_keys.update(m.decode() for m in _CREDENTIAL.findall(request))
                cwriter.write(_answer_503(request))
                await cwriter.drain()
                self.fired[mode] += 1
            except (ConnectionError, OSError):
                pass
            finally:
                cwriter.close()
            return
        try:
            ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            _reset(cwriter)
            return
        try:
            if mode == "reset_before":
                await creader.read(_CHUNK)
                self.fired[mode] += 1
                _reset(cwriter)
                return
            delay = self.latency_s if mode == "slow" else 0.0
            if mode == "slow":
                self.fired[mode] += 1
            up = asyncio.ensure_future(self._pump(creader, uwriter, delay,
                                                  cut if mode == "truncate_request" else None, mode, tap=True))
            down = asyncio.ensure_future(self._pump(ureader, cwriter, delay,
                                                    cut if mode == "truncate" else None, mode,
                                                    drop=mode == "reset_after"))
            done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if any(t.result() == "cut" for t in done):
                _reset(cwriter)
                _reset(uwriter)
            for t in pending:
                t.cancel()
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (cwriter, uwriter):
                if not w.transport.is_closing():
                    w.close()

    async def _pump(self, reader, writer, delay: float, cut: int | None, mode: str, drop: bool = False,
                    tap: bool = False) -> str:
        sent, tail = 0, b""
        try:
            while True:
                data = await reader.read(_CHUNK)
                if tap:  # a header split across two reads is still seen: keep the previous read's end
                    seen = tail + data
                    self.access_keys.update(m.decode() for m in _CREDENTIAL.findall(seen))
                    tail = seen[-256:]
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return "eof"
                if drop:  # reset_after: the server answered; the client never hears it
                    self.fired[mode] += 1
                    return "cut"
                if cut is not None and sent + len(data) >= cut:
                    writer.write(data[: max(0, cut - sent)])
                    await writer.drain()
                    self.fired[mode] += 1
                    return "cut"
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
                sent += len(data)
        except (ConnectionError, OSError, asyncio.CancelledError):
            return "closed"
