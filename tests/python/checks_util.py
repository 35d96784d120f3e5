"""checks_util.py: what the binding's check tests share."""
import contextlib

import pytest

import mok


@contextlib.contextmanager
def raises(code, *words):
    """Asserts that the block raises MokError with `code`, its message holding each of `words`."""
    with pytest.raises(mok.MokError) as info:
        yield info
    assert info.value.code == code, f"code {info.value.code}, expected {code}: {info.value}"
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
