"""The run-time guards' device-assert messages fit CUDA's limit (torch 2.11 refuses 255 characters or more:
found on the H200, where the packed check then failed with "Message length must be smaller than 255")."""

from __future__ import annotations

from cpcompile.regions.guards import COND_DIFFERS, DIFFERS, MAX_MESSAGE, bad_cu_message


def test_assert_messages_fit():
    longest = bad_cu_message(10**12, 10**12, 2, 10**6)
    assert "cu[-1]=1000000000000" in longest and "2*cp=2000000" in longest
    for message in (DIFFERS, COND_DIFFERS, longest, bad_cu_message(8, None, 0, 2)):
        assert len(message) <= MAX_MESSAGE, (len(message), message)
