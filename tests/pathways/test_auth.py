"""Secrets and message authentication (pathways/auth.py): a MAC verifies only for its key, its purpose and
exactly its parts; credentials are stored as digests."""

from __future__ import annotations

import itertools

import pytest

from pathways import auth

KEY = auth.new_key()
PURPOSES = ["submit", "fetch", "free", "rm", "deliver", "order"]


@pytest.mark.parametrize("signed, checked", list(itertools.permutations(PURPOSES, 2)))
def test_a_mac_for_one_purpose_never_verifies_for_another(signed, checked):
    mac = auth.sign(KEY, signed, 3, b"payload")
    assert auth.verify(KEY, mac, signed, 3, b"payload")
    assert not auth.verify(KEY, mac, checked, 3, b"payload")


def test_a_mac_verifies_only_under_its_own_key():
    mac = auth.sign(KEY, "submit", b"x")
    assert not auth.verify(auth.new_key(), mac, "submit", b"x")


@pytest.mark.parametrize("parts, other", [
    ((b"ab", b"c"), (b"a", b"bc")),  # parts are length-prefixed: moving a boundary changes the MAC
    ((b"abc",), (b"ab", b"c")),
    ((1, 2), (2, 1)),  # order counts
    ((b"x",), (b"x", b"")),  # an empty part counts too
    ((1,), (-1,)),
    ((b"payload",), (b"payloaD",)),
], ids=["boundary", "split", "order", "empty part", "sign", "one byte"])
def test_a_mac_covers_exactly_its_parts(parts, other):
    mac = auth.sign(KEY, "submit", *parts)
    assert auth.verify(KEY, mac, "submit", *parts)
    assert not auth.verify(KEY, mac, "submit", *other)


def test_the_purpose_is_not_a_part():
    """A purpose and a first part cannot trade places: ``sign("ab")`` is not ``sign("a", "b")``."""
    assert auth.sign(KEY, "ab") != auth.sign(KEY, "a", "b")


def test_ints_are_signed_as_fixed_width_signed_numbers():
    assert auth.sign(KEY, "p", 1) != auth.sign(KEY, "p", b"\x01")
    assert auth.verify(KEY, auth.sign(KEY, "p", -5, 2**100), "p", -5, 2**100)


@pytest.mark.parametrize("part", [True, 1.5, None, [1]])
def test_only_bytes_str_and_int_can_be_signed(part):
    with pytest.raises(TypeError, match="cannot sign"):
        auth.sign(KEY, "p", part)


@pytest.mark.parametrize("mac", [None, "a string", b"", b"\x00" * 32, 12])
def test_anything_but_the_right_mac_fails_verification(mac):
    assert not auth.verify(KEY, mac, "submit", b"x")


def test_a_tampered_mac_fails_verification():
    mac = bytearray(auth.sign(KEY, "submit", b"x"))
    mac[0] ^= 1
    assert not auth.verify(KEY, bytes(mac), "submit", b"x")


def test_credentials_are_fresh_256_bit_secrets_kept_as_digests():
    secrets = {auth.new_secret() for _ in range(100)}
    assert len(secrets) == 100 and all(len(s) >= 43 for s in secrets)  # 32 bytes, URL-safe base64
    secret = secrets.pop()
    stored = auth.digest(secret)
    assert stored != secret and len(stored) == 64
    assert auth.matches(secret, stored) and not auth.matches(secret + "x", stored)
    assert len(auth.new_key()) == auth.KEY_BYTES and auth.new_key() != auth.new_key()
