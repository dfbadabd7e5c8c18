"""Waiting for every one of N workers without O(N) work per message."""

from __future__ import annotations

from typing import Callable, Iterable, List


class Arrivals:
    """True once ``has(key)`` holds for every key; for facts that never become false again
    (a worker built, a held/ready report of one generation). Each call resumes where the last
    one stopped, so N messages cost O(N) checks in all, not O(N) each."""

    def __init__(self, keys: Iterable[str], has: Callable[[str], bool]) -> None:
        self._keys: List[str] = list(keys)
        self._has = has
        self._i = 0

    def __call__(self) -> bool:
        keys, has = self._keys, self._has
        while self._i < len(keys) and has(keys[self._i]):
            self._i += 1
        return self._i == len(keys)

    def missing(self) -> List[str]:
        return [k for k in self._keys[self._i :] if not self._has(k)]
