"""What a handler raises, and why a feed stops."""


class HandlerError(Exception):
    """Base of what a handler raises to say it could not apply updates."""


class TransientError(HandlerError):
    """Retry later (a dependency is down): the message is redelivered (nak, 1 s)."""


class PoisonError(HandlerError):
    """Never going to work: the message is terminated and counted (`status.poison`)."""


class FeedError(Exception):
    """The feed cannot go on (NATS unreachable, a stream missing, a bootstrap failed)."""


class CorruptError(FeedError):
    """A stored message does not decode."""
