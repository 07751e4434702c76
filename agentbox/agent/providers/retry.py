"""Retrying a model call that failed with a retryable error (rate limits, overload, timeouts).

3 attempts; the wait before retry n is `base_delay * 2**(n-1)`, stretched by up to `jitter`
so that many sessions hitting the same limit do not come back in step; a `retry-after` the
provider sent wins (capped at `max_delay`). Each retry is reported through `on_retry` before
the wait, so the loop can emit `session.error` with the attempt and the delay. The last
error propagates unchanged, as do errors that are not retryable.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from agentbox.agent.models import Model, ModelError, ModelRequest, Reply
from agentbox.agent.providers.errors import RateLimited

#: Attempts of one call, the first included.
ATTEMPTS = 3
#: Seconds before the first retry; doubled for each further one.
BASE_DELAY = 2.0
#: Up to this fraction of the delay is added at random.
JITTER = 0.25
#: No wait is longer than this, not even one a `retry-after` asks for.
MAX_DELAY = 60.0

T = TypeVar("T")
OnRetry = Callable[[ModelError, int, float], Awaitable[None]]
"""Called with (the error, the attempt that failed (1-based), seconds until the next one)."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = ATTEMPTS
    base_delay: float = BASE_DELAY
    jitter: float = JITTER
    max_delay: float = MAX_DELAY

    def delay(self, attempt: int, error: ModelError, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based)."""
        if isinstance(error, RateLimited) and error.retry_after is not None:
            return min(error.retry_after, self.max_delay)
        backoff = self.base_delay * 2 ** (attempt - 1)
        return min(backoff * (1 + self.jitter * rand()), self.max_delay)


async def with_retries(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy | None = None,
    on_retry: OnRetry | None = None,
) -> T:
    """`await call()`, again after a retryable `ModelError`, up to `policy.attempts` in all."""
    policy = policy or RetryPolicy()
    for attempt in range(1, policy.attempts + 1):
        try:
            return await call()
        except ModelError as error:
            if not error.retryable or attempt >= policy.attempts:
                raise
            delay = policy.delay(attempt, error)
            if on_retry is not None:
                await on_retry(error, attempt, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


class RetryingModel:
    """A `Model` whose `query` retries by `policy` (for callers that do not retry themselves)."""

    def __init__(self, model: Model, policy: RetryPolicy | None = None, on_retry: OnRetry | None = None):
        self.model, self.policy, self.on_retry = model, policy or RetryPolicy(), on_retry
        self.name = model.name

    async def query(self, request: ModelRequest) -> Reply:
        return await with_retries(lambda: self.model.query(request), self.policy, self.on_retry)
