"""The request body's reader (``app._read_body``) on the asyncio of Python 3.10, the oldest Python
pyproject.toml admits: it has no ``asyncio.timeout`` (3.11's), and its ``asyncio.TimeoutError`` is
not the built-in ``TimeoutError``."""
from __future__ import annotations

import asyncio

import pytest

from aiayn.serve.app import ApiError, _read_body


class Body:
    """A request whose body arrives as ``chunks``, then stalls for ``stall_s`` (a client gone quiet)."""

    def __init__(self, chunks: list[bytes], stall_s: float = 0.0):
        self.headers, self.chunks, self.stall_s = {}, chunks, stall_s

    async def stream(self):
        for chunk in self.chunks:
            yield chunk
        if self.stall_s:
            await asyncio.sleep(self.stall_s)


@pytest.fixture
def python310_asyncio(monkeypatch):
    monkeypatch.delattr(asyncio, "timeout", raising=False)
    monkeypatch.setattr(asyncio, "TimeoutError", type("TimeoutError", (Exception,), {}))  # 3.10's own class
    real = asyncio.wait_for

    async def wait_for(aw, timeout):  # 3.10's raises its own TimeoutError
        try:
            return await real(aw, timeout)
        except TimeoutError:
            raise asyncio.TimeoutError() from None
    monkeypatch.setattr(asyncio, "wait_for", wait_for)


def test_a_body_is_read_whole(python310_asyncio):
    assert asyncio.run(_read_body(Body([b'{"sentences": ', b'["A dog."]}']), 100, 5.0)) == b'{"sentences": ["A dog."]}'


def test_a_body_over_the_limit_is_413(python310_asyncio):
    with pytest.raises(ApiError) as err:
        asyncio.run(_read_body(Body([b"x" * 60, b"x" * 60]), 100, 5.0))
    assert err.value.status == 413


def test_a_stalled_body_is_408(python310_asyncio):
    with pytest.raises(ApiError) as err:
        asyncio.run(_read_body(Body([b"{"], stall_s=30.0), 100, 0.05))
    assert err.value.status == 408 and "did not arrive within 0.05 s" in err.value.message
