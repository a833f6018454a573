"""The scrape client against engines that answer as an attacker would: oversized, 1-byte chunks, never ending,
not HTTP. Real sockets on loopback; each server writes exactly the bytes given."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvgate.epp.datalayer.http_client import MAX_CHUNKS, MAX_HEADER_BYTES, MetricsConnection, ScrapeError

LIMIT = 256 * 1024


class RawServer:
    """Answers every request on a connection with `answer(writer)` (a coroutine writing whatever it likes)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, reader, writer) -> None:
        self.tasks.add(asyncio.current_task())
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await self.answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def chunked(body: bytes, size: int) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size))
            + b"0\r\n\r\n")


async def scrape(answer, timeout: float = 5.0, max_bytes: int = LIMIT) -> tuple[int, bytes]:
    async with RawServer(answer) as address:
        connection = MetricsConnection(address, timeout=timeout, max_bytes=max_bytes)
        try:
            return await connection.get()
        finally:
            connection.close()


def run(coro):
    return asyncio.run(coro)


def writing(data: bytes):
    async def answer(writer):
        writer.write(data)
        await writer.drain()
    return answer


def test_a_normal_page_by_length_and_by_chunks():
    body = b"vllm:num_requests_waiting 1\n" * 100
    assert run(scrape(writing(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)))) == (200, body)
    assert run(scrape(writing(chunked(body, 7)))) == (200, body)


def test_a_body_over_the_limit_fails_the_scrape():
    with pytest.raises(ScrapeError) as e:  # by its Content-Length, before any of the body is read
        run(scrape(writing(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1))))
    assert e.value.reason == "too_large"
    with pytest.raises(ScrapeError) as e:  # chunked: as it grows past the limit
        run(scrape(writing(chunked(b"x" * (LIMIT + 1), 4096))))
    assert e.value.reason == "too_large"
    with pytest.raises(ScrapeError) as e:  # headers without end
        run(scrape(writing(b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * (MAX_HEADER_BYTES // 8 + 1))))
    assert e.value.reason == "too_large"


def test_one_byte_chunks_cost_their_wire_bytes_not_their_square():
    """MAX_CHUNKS 1-byte chunks are read whole (the quadratic re-decoding this replaced took minutes for them); one
    chunk more fails the scrape, and so do more than twice the limit's bytes on the wire."""
    body = bytes(range(97, 123)) * (MAX_CHUNKS // 26) + b"z" * (MAX_CHUNKS % 26)
    started = time.process_time()
    assert run(scrape(writing(chunked(body, 1)), timeout=30)) == (200, body)
    assert time.process_time() - started < 10
    with pytest.raises(ScrapeError) as e:
        run(scrape(writing(chunked(body + b"!", 1))))
    assert e.value.reason == "too_large" and "chunks" in str(e.value)
    with pytest.raises(ScrapeError) as e:  # 6 wire bytes a body byte: past 2 x 128 KiB + the headers' allowance
        run(scrape(writing(chunked(body, 1)), max_bytes=128 * 1024))
    assert e.value.reason == "too_large" and "wire" in str(e.value)


def test_the_cost_of_reading_an_answer_is_measured():
    async def main():
        async with RawServer(writing(chunked(b"q" * 60_000, 1))) as address:
            connection = MetricsConnection(address, timeout=10, max_bytes=LIMIT)
            try:
                await connection.get()
                return connection.cost_s
            finally:
                connection.close()

    assert 0 < run(main()) < 10


def test_a_body_that_never_ends_is_cut_by_the_timeout():
    async def trickle(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(10_000):
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        run(scrape(trickle, timeout=0.5))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("answer", [
    bytes(range(256)) * 4,
    b"HTTP/1.1 200 OK\r\n\r\nno length, no chunks",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999999\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
], ids=["garbage", "unframed", "two-lengths", "bad-chunk-size", "negative-length", "huge-length", "upgrade"])
def test_malformed_answers_fail_the_scrape_cleanly(answer):
    with pytest.raises(ScrapeError):
        run(scrape(writing(answer), timeout=2))


def test_bytes_past_the_answer_do_not_reach_the_next_one():
    body = b"ok\n"
    extra = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"

    async def main():
        async with RawServer(writing(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n" + body + extra)) as address:
            connection = MetricsConnection(address, timeout=2, max_bytes=LIMIT)
            try:
                first = await connection.get()
                second = await connection.get()
            finally:
                connection.close()
            return first, second

    first, second = run(main())
    assert first == (200, body) and second == (200, body)
