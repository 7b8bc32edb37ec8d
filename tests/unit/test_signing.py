"""What a signature can cover: every file of a signed checkpoint or manifest must carry a
SHA-256 checksum (a CRC can be forged), and signatures are checked in constant time."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from statebackend.checkpoint.signing import SigningKey, check_signable, check_signature
from statebackend.errors import CheckpointCorruptedError, CheckpointError
from statebackend.snapshot.handles import StoredFile

KEY = SigningKey(b"k" * 32)


def test_only_sha256_checksummed_files_can_be_signed() -> None:
    strong = StoredFile("chk-1/a", 10, "sha256:" + "0" * 64)
    weak = StoredFile("chk-1/b", 10, "crc32:00000000")
    check_signable([strong], "checkpoint 1", "write it with the key")
    with pytest.raises(CheckpointError, match=r"cannot sign checkpoint 1: chk-1/b have no") as err:
        check_signable([strong, weak], "checkpoint 1", "write it with the key")
    assert "chk-1/a" not in str(err.value) and str(err.value).endswith("write it with the key")


def test_a_signature_is_the_hmac_sha256_of_the_payload() -> None:
    payload = b'{"batch_id":3}'
    expected = hmac.new(KEY.secret, payload, hashlib.sha256).hexdigest()
    signature = {"algorithm": "hmac-sha256", "value": expected}
    assert KEY.sign(payload) == expected
    check_signature(payload, signature, KEY, "manifests/3")
    with pytest.raises(CheckpointCorruptedError, match="manifests/3: the signature does not"):
        check_signature(payload + b" ", signature, KEY, "manifests/3")
    with pytest.raises(CheckpointCorruptedError, match="manifests/3 is not signed"):
        check_signature(payload, None, KEY, "manifests/3")
