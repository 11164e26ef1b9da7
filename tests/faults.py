"""Fault injection: a loopback TCP proxy in front of Redis or Postgres that can drop every connection, or
stall them all."""

from __future__ import annotations

import asyncio
import contextlib


class DroppingProxy:
    """Forwards 127.0.0.1:<port> to a target; `drop()` resets every connection open at that moment.

    A dropped connection is aborted on both sides (an RST, not a clean close), as a crashed proxy, a
    restarted server or a network partition does to a client in the middle of its requests.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.drops = 0
        self.refusing = False  # while set, new connections are reset as soon as they are accepted
        # While set, nothing is forwarded either way and the connections stay open: a partition without a
        # reset, or a database that stopped answering.
        self.stalled = False
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> DroppingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
                self._tasks.discard(task)
            self._pairs.discard(pair)
            writer.transport.abort()
            up_writer.transport.abort()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await source.read(65536):
                if self.stalled:
                    continue  # lost on the way
                sink.write(data)
                await sink.drain()

    def drop(self) -> int:
        """Reset every open connection; returns how many were dropped."""
        pairs = list(self._pairs)
        for client, upstream in pairs:
            client.transport.abort()
            upstream.transport.abort()
        self.drops += len(pairs)
        return len(pairs)

    async def outage(self, seconds: float) -> None:
        """Reset every open connection and every new one for `seconds`: the target is unreachable."""
        self.refusing = True
        self.drop()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.refusing = False

    async def aclose(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
