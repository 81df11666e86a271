"""The front end -> DP controller channel (`common/server/frame_stream.py`): message framing
over a real Unix stream socket, partial reads, large and many-frame messages, a corrupt
stream, the asyncio sender's backlog when the reader falls behind, and a broken connection."""

from __future__ import annotations

import asyncio
import random
import select
import socket
import struct
import threading

import pytest

from common.server import frame_stream
from common.server.frame_stream import AsyncFrameSender, FrameReader, FrameStreamError


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def _read_all(reader: FrameReader, count: int, timeout: float = 5.0) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    while len(got) < count:
        assert select.select([reader.sock], [], [], timeout)[0], f"got {len(got)} of {count}"
        messages = reader.read()
        assert messages is not None, "peer closed early"
        got += [[bytes(f) for f in msg] for msg in messages]  # views: copy before next read
    return got


@pytest.fixture
def channel(tmp_path):
    """open(on_broken=None) -> (listener, the front end's sender connected to it, the accepted
    connection); all closed at the end of the test, whatever happened."""
    opened = []

    def open_channel(on_broken=None):
        path = str(tmp_path / f"c{len(opened)}.sock")
        listener = frame_stream.listen(path)
        sender = AsyncFrameSender(path, on_broken=on_broken)
        conn, _ = listener.accept()
        opened.append((listener, sender, conn))
        return listener, sender, conn

    yield open_channel
    for listener, sender, conn in opened:
        sender.close()
        conn.close()
        listener.close()


async def _read_async(conn: socket.socket, reader: FrameReader, count: int) -> list[list[bytes]]:
    """Like _read_all, waiting in a thread so that the loop's writer keeps sending."""
    got: list[list[bytes]] = []
    loop = asyncio.get_running_loop()
    while len(got) < count:
        ready = await loop.run_in_executor(None, select.select, [conn], [], [], 5)
        assert ready[0], f"stalled at {len(got)} of {count}"
        got += [[bytes(f) for f in msg] for msg in reader.read()]
        await asyncio.sleep(0)
    return got


def test_messages_round_trip_whole_and_in_order():
    a, b = _pair()
    reader = FrameReader(b)
    sent = [[b"head", b"body"], [b"control"], [b"h", b"", b"x" * 1000], [b""]]
    for frames in sent:
        frame_stream.send_blocking(a, frames)
    assert _read_all(reader, len(sent)) == sent
    a.close()
    assert select.select([b], [], [], 2)[0]
    assert reader.read() is None  # the peer closed
    b.close()


def test_a_stream_cut_anywhere_parses_the_same():
    """Bytes arriving one at a time (or in odd chunks) give the same messages, each exactly
    once, only when complete."""
    rng = random.Random(3)
    sent = [[bytes([i]) * rng.randrange(0, 300) for _ in range(rng.randrange(1, 5))]
            for i in range(40)]
    blob = b"".join(b for frames in sent for b in frame_stream.encode_message(frames))
    for chunking in ("bytes", "random"):
        a, b = _pair()
        reader = FrameReader(b)
        got, pos = [], 0
        while pos < len(blob):
            step = 1 if chunking == "bytes" else rng.randrange(1, 700)
            a.sendall(blob[pos:pos + step])
            pos += step
            select.select([b], [], [], 2)
            got += [[bytes(f) for f in msg] for msg in reader.read()]
        got += _read_all(reader, len(sent) - len(got)) if len(got) < len(sent) else []
        assert got == sent, chunking
        a.close()
        b.close()


def test_a_message_larger_than_the_buffer_grows_it():
    a, b = _pair()
    reader = FrameReader(b)
    big = bytes(range(256)) * (4 * 1024 * 8)  # 8 MiB, 32x the initial buffer
    small = [b"after", b"it"]

    def write():
        frame_stream.send_blocking(a, [b"h", big])
        frame_stream.send_blocking(a, small)

    writer = threading.Thread(target=write)
    writer.start()
    got = _read_all(reader, 2, timeout=10)
    writer.join(10)
    assert got[0][0] == b"h" and got[0][1] == big
    assert got[1] == small
    a.close()
    b.close()


def test_many_frames_in_one_message():
    """More buffers than one sendmsg may carry: the message is joined first; the count is not
    limited to 16 bits (an HTTP batch of 65,535+ prompts is one message)."""
    frames = [str(i).encode() for i in range(70_000)]
    assert len(frame_stream.encode_message(frames)) == 1
    a, b = _pair()
    reader = FrameReader(b)
    writer = threading.Thread(target=frame_stream.send_blocking, args=(a, frames))
    writer.start()  # ~600 KB: more than the socket buffer holds
    assert _read_all(reader, 1) == [frames]
    writer.join(10)
    a.close()
    b.close()


def test_message_limits(monkeypatch):
    with pytest.raises(ValueError):
        frame_stream.encode_message([])
    monkeypatch.setattr(frame_stream, "MAX_MESSAGE_BYTES", 1000)
    for frames in ([b"x" * 1000], [b"h", b"x" * 1000], [b"a"] * 300):
        with pytest.raises(ValueError, match="over the channel's limit"):
            frame_stream.encode_message(frames)
    assert len(frame_stream.encode_message([b"h", b"x" * 900])) == 3


@pytest.mark.parametrize("corrupt", [
    struct.pack("<I", 1) + b"\x00",  # shorter than its frame count
    struct.pack("<II", 4, 0),  # no frame
    struct.pack("<III", 12, 1, 99) + b"\x00" * 4,  # frame lengths past the message
    struct.pack("<I", frame_stream.MAX_MESSAGE_BYTES + 1),  # absurd length
])
def test_a_corrupt_stream_is_an_error_not_a_misread(corrupt):
    a, b = _pair()
    reader = FrameReader(b)
    frame_stream.send_blocking(a, [b"fine"])
    a.sendall(corrupt)
    select.select([b], [], [], 2)
    with pytest.raises(FrameStreamError):
        while True:  # the good message may come in the same read as the bad bytes
            assert reader.read() is not None
    a.close()
    b.close()


async def test_async_sender_queues_what_the_socket_cannot_take_and_keeps_order(channel):
    """A reader that is not reading: the sender's writes never block the loop; everything is
    delivered in order once the reader catches up."""
    listener, sender, conn = channel()
    reader = FrameReader(conn)
    sent = [[b"%d" % i, bytes([i % 256]) * 50_000] for i in range(100)]  # ~5 MB
    for frames in sent:
        sender.send(frames)  # returns at once
    assert sender.backlog_bytes > 0  # the kernel buffer filled up
    assert await _read_async(conn, reader, len(sent)) == sent
    assert sender.backlog_bytes == 0


async def test_async_sender_backlog_with_empty_frames_drains(channel):
    """Empty frames behind a backlog are not queued (an empty buffer would never drain)."""
    listener, sender, conn = channel()
    reader = FrameReader(conn)
    sent = [[b"x" * 4_000_000, b"h"], [b"y", b""], [b""]]
    for frames in sent:
        sender.send(frames)
    assert sender.backlog_bytes > 0
    assert await _read_async(conn, reader, len(sent)) == sent
    for _ in range(100):  # the writer finished and unregistered itself
        if sender._loop is None:
            break
        await asyncio.sleep(0.01)
    assert sender.backlog_bytes == 0 and sender._loop is None


async def test_async_sender_after_close_refuses_without_reporting_a_broken_channel(channel):
    broken = []
    listener, sender, conn = channel(broken.append)
    sender.close()
    with pytest.raises(ConnectionError):
        sender.send([b"x"])
    assert broken == []


async def test_async_sender_reports_a_closed_peer(channel):
    broken = []
    listener, sender, conn = channel(broken.append)
    conn.close()
    listener.close()
    with pytest.raises(ConnectionError):
        for _ in range(100):  # the first writes may still land in the kernel buffer
            sender.send([b"x" * 10_000])
            await asyncio.sleep(0.01)
    with pytest.raises(ConnectionError):  # and it stays closed
        sender.send([b"y"])
    assert len(broken) == 1 and "DP controller channel is closed" in broken[0]


def test_listen_replaces_a_stale_socket_file(tmp_path):
    path = str(tmp_path / "c.sock")
    first = frame_stream.listen(path)
    first.close()  # the file stays, as after a crash
    second = frame_stream.listen(path)
    client = frame_stream.connect(path)
    conn, _ = second.accept()
    frame_stream.send_blocking(client, [b"ok"])
    assert _read_all(FrameReader(conn), 1) == [[b"ok"]]
    for s in (client, conn, second):
        s.close()
