"""Network faults for tests: a loopback TCP proxy that can pass, delay, blackhole, reset or
refuse what goes through it.

::

    with FaultProxy(6379) as proxy:          # 127.0.0.1:<proxy.port> -> 127.0.0.1:6379
        client = redis.Redis(port=proxy.port)
        proxy.set("blackhole")               # bytes are held, nothing answers
        proxy.set("pass")                    # held bytes flow again, in order

=========  ==================================================================
mode       what a client sees
=========  ==================================================================
pass       the server, unchanged
delay      every chunk arrives ``delay`` seconds late, in order, both ways
blackhole  connects succeed, nothing is delivered or answered (a dead link)
reset      open connections are reset (RST); new ones are reset at once
refuse     the port stops listening: connects fail with ECONNREFUSED
cut        requests reach the server; the next reply is dropped and that connection
           reset (the server applied the request, the client never learns it did),
           then the proxy passes again
=========  ==================================================================

The proxy runs its own event loop in a daemon thread; ``set`` returns once the new mode
applies to every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

MODES = ("pass", "delay", "blackhole", "reset", "refuse", "cut")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self.mode = "pass"
        self.delay = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._changed: asyncio.Event | None = None

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._call(self._close_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def set(self, mode: str, delay: float = 0.0) -> None:
        """Switch to ``mode`` (one of ``MODES``); ``delay`` seconds for "delay"."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._call(self._apply(mode, delay))

    # -- inside the proxy's loop --------------------------------------------------------

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )

    async def _apply(self, mode: str, delay: float) -> None:
        self.mode, self.delay = mode, delay
        assert self._changed is not None
        self._changed.set()  # wake pumps held by a blackhole
        self._changed = asyncio.Event()
        if mode in ("reset", "refuse"):
            for writer in list(self._writers):
                _reset(writer)
        if mode == "refuse" and self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        elif mode != "refuse" and self._server is None:
            await self._listen()

    async def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.mode == "reset":
            _reset(client_w)
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(client_w)
            return
        self._writers |= {client_w, server_w}
        try:
            await asyncio.gather(
                self._pump(client_r, server_w),
                self._pump(server_r, client_w, replies=True, cut=(client_w, server_w)),
            )
        finally:
            self._writers -= {client_w, server_w}
            for writer in (client_w, server_w):
                writer.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        replies: bool = False,
        cut: tuple[asyncio.StreamWriter, ...] = (),
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if replies and self.mode == "cut":
                    self.mode = "pass"  # one reply only: the client's next connection works
                    for end in cut:
                        _reset(end)
                    return
                while self.mode == "blackhole":  # hold the bytes until the link heals
                    assert self._changed is not None
                    await self._changed.wait()
                if self.mode == "delay":
                    await asyncio.sleep(self.delay)
                if self.mode in ("reset", "refuse"):
                    return
                writer.write(data)
                await writer.drain()
        if not writer.is_closing():
            with contextlib.suppress(OSError):
                writer.write_eof()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, as a crashed peer or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
