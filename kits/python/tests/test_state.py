"""The kit's bookkeeping, without servers (the twins of shared/feed/src/state.rs's tests)."""

from shelfsync_kit import Digest, FeedState, PlaceKey, pb

P = PlaceKey(7, 1)


def mark(d: Digest, cutoff: int = 0) -> pb.KeyframeMark:
    return pb.KeyframeMark(digest=d.sum, total=d.count, tombstone_cutoff=cutoff)


def test_newer_only_and_the_digest_follows():
    s = FeedState()
    assert s.is_newer(P, "a", 5)
    s.record(P, "a", 5, False)
    assert not s.is_newer(P, "a", 5) and not s.is_newer(P, "a", 4) and s.is_newer(P, "a", 6)
    s.record(P, "a", 6, False)
    expected = Digest()
    expected.add("a", 6)
    assert s.digest(P) == expected
    assert s.check(P, mark(expected)) is None


def test_expired_tombstones_leave_the_digest_at_a_check():
    s = FeedState()
    s.record(P, "live", 10, False)
    s.record(P, "old-tomb", 20, True)
    s.record(P, "new-tomb", 40, True)
    kf = Digest()
    kf.add("live", 10)
    kf.add("new-tomb", 40)
    assert s.check(P, mark(kf, cutoff=30)) is None
    assert len(s) == 2


def test_a_missed_change_is_drift():
    s = FeedState()
    s.record(P, "a", 1, False)
    kf = Digest()
    kf.add("a", 2)
    assert s.check(P, mark(kf)) is not None
    # An unknown place with records in the keyframe is drift too.
    assert s.check(PlaceKey(7, 2), mark(kf)) is not None
