"""The kit against real servers and the real storage binary: bootstrap from a
keyframe, live changes, a drift repaired, a restart that resumes."""

from __future__ import annotations

import asyncio

from harness import Mirror, delete, eventually, patch

from shelfsync_kit import Bootstrap, ChangeFeed, FeedConfig, PlaceKey

BRAND = 7


def feed_of(stack, name: str, **cfg) -> ChangeFeed:
    # Idle pulls of 0.25 s: a stopped feed returns that fast (the default is 1 s).
    return ChangeFeed(stack.nc, FeedConfig(name, prefix=stack.prefix, fetch_timeout=0.25, **cfg))


async def start_bootstrapped(stack, run_feed, name: str, mirror: Mirror, **cfg):
    feed = feed_of(stack, name, **cfg)
    running = run_feed(feed, mirror)
    await eventually("the feed to bootstrap", lambda: feed.status.bootstrapped or running.task.done())
    if running.task.done():
        running.task.result()  # raises what stopped it
    return feed, running


async def caught_up(stack, feed, mirror, places) -> None:
    """Until the feed's consumer has nothing pending or unacked and the mirror
    holds what storage holds (call after `stack.wait_applied()`)."""

    async def done() -> bool:
        _, pending, ack_pending = await stack.consumer_delivered(feed.cfg.name)
        return (pending == 0 and ack_pending == 0
                and await mirror.equals_storage(stack, BRAND, places))

    await eventually("the feed to catch up with storage", done)


async def lose_new_changes(stack, write) -> None:
    """Runs `write`, then deletes the change messages it caused from the stream:
    changes a consumer never sees."""
    before = await stack.changes_last_seq()
    await write()
    await stack.wait_applied()
    last = await stack.changes_last_seq()
    assert last > before, "the write caused changes"
    for seq in range(before + 1, last + 1):
        assert await stack.jsm.delete_msg(stack.subjects.changes_stream(), seq)


async def test_bootstrap_asks_storage_for_a_keyframe_then_tails_live_changes(stack, run_feed):
    await stack.write(BRAND, [1, 2], 300, 100)
    await stack.wait_applied()
    mirror = Mirror()
    feed, _ = await start_bootstrapped(stack, run_feed, "kit-boot", mirror)
    # No keyframe existed: the kit asked storage for one and loaded it.
    assert mirror.kinds["snapshot"] == 600
    assert feed.status.delivered == 600
    await mirror.assert_equals_storage(stack, BRAND, [1, 2])

    await stack.send([
        patch(BRAND, 1, "sku-0", 5000),
        delete(BRAND, 1, "sku-1"),
        patch(BRAND, 2, "new-1", 7),
        patch(BRAND, 2, "sku-2", 6000),
    ])
    await stack.wait_applied()
    await caught_up(stack, feed, mirror, [1, 2])
    assert (mirror.kinds["created"], mirror.kinds["updated"], mirror.kinds["deleted"]) == (1, 2, 1)
    assert mirror.records[(BRAND, 1, "sku-1")].deleted
    assert feed.status.delivered == 604

    # The next keyframe's markers agree with the kit's digests.
    await stack.keyframe()
    # The markers of the bootstrap's keyframe and of this one, two places each.
    await eventually("four markers checked", lambda: feed.status.keyframe_checks >= 4)
    assert feed.status.drift_repairs == 0
    mirror.assert_applied_once()
    for place in (1, 2):
        assert feed.state.digest(PlaceKey(BRAND, place)).count == len(mirror.of_place(BRAND, place))


async def test_bootstrap_from_the_latest_keyframe_of_one_place(stack, run_feed):
    await stack.write(BRAND, [1, 2, 3], 50, 100)
    await stack.wait_applied()
    await stack.keyframe()
    await stack.write(BRAND, [2], 10, 900)  # after the keyframe: read from the change stream
    await stack.wait_applied()
    mirror = Mirror()
    feed, _ = await start_bootstrapped(stack, run_feed, "kit-one-place", mirror,
                                       brand=BRAND, place=2, request_keyframe_if_missing=False)
    assert mirror.kinds["snapshot"] == 50
    await caught_up(stack, feed, mirror, [2])
    assert mirror.kinds["updated"] == 10
    assert {k[1] for k in mirror.records} == {2}, "only the place of the filter"

    await stack.send([patch(BRAND, 1, "sku-0", 1), patch(BRAND, 2, "sku-0", 2)])
    await stack.wait_applied()
    await caught_up(stack, feed, mirror, [2])
    assert {k[1] for k in mirror.records} == {2}
    mirror.assert_applied_once()


async def test_a_consumer_that_missed_changes_is_repaired_at_the_next_keyframe(stack, run_feed):
    await stack.write(BRAND, [1, 2], 100, 100)
    await stack.wait_applied()
    mirror = Mirror()
    feed, running = await start_bootstrapped(stack, run_feed, "kit-drift", mirror)

    # Changes lost before the consumer saw them: paused, written, deleted.
    await running.stop()
    await lose_new_changes(stack, lambda: stack.write(BRAND, [1], 10, 5000))
    fresh = (await stack.records(BRAND, 1))["sku-0"].updated_at
    run_feed(feed, mirror)  # resumed: the lost changes never come
    assert mirror.updated_at(BRAND, 1, "sku-0") != fresh, "the mirror missed the change"

    # The next keyframe's marker reveals the drift of place 1 (only) and repairs it.
    await stack.keyframe()
    await eventually("the drift repaired", lambda: feed.status.drift_repairs == 1
                     and mirror.updated_at(BRAND, 1, "sku-0") == fresh)
    # The markers of the bootstrap's keyframe and of this one, two places each.
    await eventually("four markers checked", lambda: feed.status.keyframe_checks >= 4)
    assert feed.status.drift_repairs == 1, "place 2 did not drift"
    assert mirror.resets.count((BRAND, 1)) == 2 and mirror.resets.count((BRAND, 2)) == 1
    await mirror.assert_equals_storage(stack, BRAND, [1, 2])


async def test_a_tampered_consumer_state_is_repaired(stack, run_feed):
    await stack.write(BRAND, [1], 20, 100)
    await stack.wait_applied()
    mirror = Mirror()
    feed, running = await start_bootstrapped(stack, run_feed, "kit-tamper", mirror)
    await running.stop()
    # A record the place does not have, and one with an older version than storage's.
    feed.state.record(PlaceKey(BRAND, 1), "phantom", 1, False)
    mirror.records[(BRAND, 1, "phantom")] = mirror.records[(BRAND, 1, "sku-0")]
    stored = mirror.records[(BRAND, 1, "sku-5")]
    feed.state.reset_place(PlaceKey(BRAND, 9))  # (another place: no effect)
    feed.state.record(PlaceKey(BRAND, 1), "sku-5", stored.updated_at - 1, False)
    run_feed(feed, mirror)

    await stack.keyframe()
    await eventually("the drift repaired", lambda: feed.status.drift_repairs == 1)
    assert (BRAND, 1, "phantom") not in mirror.records
    await mirror.assert_equals_storage(stack, BRAND, [1])


async def test_a_repair_keeps_what_changed_between_the_freeze_and_the_marker(make_stack, run_feed):
    # 300 records a second: place 1's keyframe takes about a second to go out.
    stack = await make_stack(SHELFSYNC__STORAGE__KEYFRAME_RATE="300")
    await stack.write(BRAND, [1], 300, 100)
    await stack.wait_applied()
    mirror = Mirror()
    feed, running = await start_bootstrapped(stack, run_feed, "kit-drift-live", mirror)
    await running.stop()
    await lose_new_changes(stack, lambda: stack.write(BRAND, [1], 1, 5000))
    run_feed(feed, mirror)

    # New records, one every 20 ms, until the keyframe is out: those written
    # between its freeze and its marker are in neither the keyframe nor any
    # change after the marker.
    done = asyncio.Event()

    async def writer() -> int:
        n = 0
        while not done.is_set():
            await stack.send([patch(BRAND, 1, f"live-{n}", 7)])
            n += 1
            await asyncio.sleep(0.02)
        return n

    async def keyframe() -> None:
        try:
            await stack.keyframe()
        finally:
            done.set()

    written, _ = await asyncio.gather(writer(), keyframe())
    assert written >= 10, f"only {written} records written during the keyframe"
    await stack.wait_applied()
    await eventually("the drift repaired, every live record delivered",
                     lambda: feed.status.drift_repairs == 1
                     and len(mirror.of_place(BRAND, 1)) == 300 + written)
    await mirror.assert_equals_storage(stack, BRAND, [1])


async def test_a_restarted_feed_resumes_where_it_stopped(stack, run_feed):
    await stack.write(BRAND, [1], 50, 100)
    await stack.wait_applied()
    mirror = Mirror()
    feed, running = await start_bootstrapped(stack, run_feed, "kit-restart", mirror)
    await stack.write(BRAND, [1], 20, 300)  # 20 updates, live
    await stack.wait_applied()
    await caught_up(stack, feed, mirror, [1])
    await running.stop()

    await stack.write(BRAND, [1], 30, 700, prefix="while-stopped")
    await stack.wait_applied()
    assert not any(k[2].startswith("while-stopped") for k in mirror.records)

    run_feed(feed, mirror)  # the same feed, its durable consumer, no second bootstrap
    await caught_up(stack, feed, mirror, [1])
    assert mirror.kinds["snapshot"] == 50 and mirror.resets == [(BRAND, 1)]
    assert (mirror.kinds["updated"], mirror.kinds["created"]) == (20, 30)
    assert feed.status.duplicates == 0
    mirror.assert_applied_once()


async def test_a_new_instance_resumes_the_shared_durable_consumer(stack, run_feed):
    first = Mirror()
    feed, running = await start_bootstrapped(stack, run_feed, "kit-shared", first,
                                             bootstrap=Bootstrap.RESUME)
    await stack.write(BRAND, [1], 20, 100)
    await stack.wait_applied()
    await eventually("the first instance applied 20", lambda: len(first.applied) == 20)
    await running.stop()

    await stack.write(BRAND, [1], 15, 500, prefix="later")
    await stack.wait_applied()
    second = Mirror()
    _, _ = await start_bootstrapped(stack, run_feed, "kit-shared", second,
                                    bootstrap=Bootstrap.RESUME)
    await eventually("the second instance applied what came after",
                     lambda: len(second.applied) == 15)
    assert all(a[2].startswith("later") for a in second.applied), "nothing applied twice"
    assert second.kinds["snapshot"] == 0
    await eventually("nothing pending", lambda: _settled(stack, "kit-shared"))
    assert len(second.applied) == 15


async def _settled(stack, name: str) -> bool:
    _, pending, ack_pending = await stack.consumer_delivered(name)
    return pending == 0 and ack_pending == 0


async def test_a_transient_handler_failure_is_retried_and_applied_once(stack, run_feed):
    mirror = Mirror()
    feed, _ = await start_bootstrapped(stack, run_feed, "kit-retry", mirror)
    mirror.fail_once.add("boom")
    await stack.send([patch(BRAND, 1, "boom", 1), patch(BRAND, 1, "calm", 2)])
    await stack.wait_applied()
    await eventually("applied after the retry", lambda: (BRAND, 1, "boom") in mirror.records)
    await caught_up(stack, feed, mirror, [1])
    assert mirror.failures == 1
    mirror.assert_applied_once()


async def test_changes_already_in_the_snapshot_are_not_applied_twice(make_stack, run_feed):
    # One place at a time, 300 records a second: the keyframe run takes seconds,
    # and a place frozen late holds changes made after the run started, which
    # the feed also reads from the change stream (from the run's changes_seq).
    stack = await make_stack(SHELFSYNC__STORAGE__KEYFRAME_RATE="300",
                             SHELFSYNC__STORAGE__KEYFRAME_CONCURRENCY="1")
    places = [1, 2, 3]
    await stack.write(BRAND, places, 200, 100)
    await stack.wait_applied()
    done = asyncio.Event()

    async def writer() -> None:
        n = 0
        while not done.is_set():
            await stack.send([patch(BRAND, p, f"sku-{n % 200}", 10_000 + n) for p in places])
            n += 1
            await asyncio.sleep(0.02)

    async def keyframe() -> None:
        try:
            await stack.keyframe()
        finally:
            done.set()

    await asyncio.gather(writer(), keyframe())
    await stack.wait_applied()
    mirror = Mirror()
    feed, _ = await start_bootstrapped(stack, run_feed, "kit-overlap", mirror,
                                       request_keyframe_if_missing=False)
    await caught_up(stack, feed, mirror, places)
    assert feed.status.duplicates > 0, "the snapshot and the change stream overlapped"
    mirror.assert_applied_once()
    await mirror.assert_equals_storage(stack, BRAND, places)
