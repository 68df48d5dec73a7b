"""The run's token read from a file: a file others can read is named with the fix."""

from __future__ import annotations

import logging
import os

import pytest

from lightning_diloco.core.token_options import read_token


def test_a_token_file_others_can_read_is_warned_about_with_the_command_that_fixes_it(tmp_path, caplog):
    path = tmp_path / "run.token"
    path.write_text("s3cret\n")
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="lightning_diloco.core.token_options"):
        assert read_token(path) == "s3cret"
    [record] = caplog.records
    assert "can be read by other users" in record.getMessage() and f"chmod 600 {path}" in record.getMessage()


def test_a_token_file_only_its_owner_reads_is_taken_quietly(tmp_path, caplog):
    path = tmp_path / "run.token"
    path.write_text("s3cret\n")
    os.chmod(path, 0o600)
    with caplog.at_level(logging.WARNING, logger="lightning_diloco.core.token_options"):
        assert read_token(path) == "s3cret"
    assert caplog.records == []


def test_a_missing_token_file_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="--token-file .*missing.*No such file"):
        read_token(tmp_path / "missing")
