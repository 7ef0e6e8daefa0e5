"""Small trio helpers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


@contextmanager
def first_error() -> Iterator[None]:
    """Re-raise the first real error of a nursery's exception group as itself.

    Sibling tasks that were cancelled because of it are noise for the user."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
        raise (real or leaves)[0] from None
