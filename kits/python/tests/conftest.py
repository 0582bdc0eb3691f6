"""Fixtures: the session's servers and, per test, its own deployment (see harness.py)."""

from __future__ import annotations

import asyncio
from typing import Dict, List

import pytest

from harness import Server, Stack, start_nats, start_redis


@pytest.fixture(scope="session")
def servers():
    nats_server = start_nats()
    try:
        redis_server = start_redis()
    except Exception:
        nats_server.stop()
        raise
    yield nats_server, redis_server
    redis_server.stop()
    nats_server.stop()


@pytest.fixture
async def make_stack(servers):
    """`await make_stack(**env)`: a deployment of its own for the test (a unique
    prefix and namespace, streams set up, the storage binary running), with
    `SHELFSYNC__...` overrides."""
    nats_server, redis_server = servers
    stacks: List[Stack] = []

    async def make(**extra_env: str) -> Stack:
        stack = Stack(nats_server.url, redis_server.url, dict(extra_env))
        stacks.append(stack)
        await stack.start()
        return stack

    yield make
    for stack in stacks:
        await stack.stop()


@pytest.fixture
async def stack(make_stack) -> Stack:
    return await make_stack()


class Running:
    """A feed running in a task until `stop()`."""

    def __init__(self, feed, handler) -> None:
        self.feed, self.handler = feed, handler
        self.stop_event = asyncio.Event()
        self.task = asyncio.ensure_future(feed.run(handler, self.stop_event))

    async def stop(self):
        self.stop_event.set()
        await asyncio.wait_for(self.task, 15)
        return self.feed


@pytest.fixture
async def run_feed():
    """`run_feed(feed, handler)`: the feed running in a task; stopped at the end."""
    running: List[Running] = []

    def start(feed, handler) -> Running:
        r = Running(feed, handler)
        running.append(r)
        return r

    yield start
    for r in running:
        if not r.task.done():
            r.stop_event.set()
            try:
                await asyncio.wait_for(r.task, 15)
            except BaseException:  # noqa: BLE001 - the test already failed or passed
                pass
