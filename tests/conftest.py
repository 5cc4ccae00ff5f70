"""Test-session setup shared by every test folder."""
import os
import tempfile
from typing import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _temp_files_stay_in_pytests_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Point TMPDIR (and so every ``tempfile`` call, in this process and in the workers and torchrun
    agents it starts) at this session's pytest folder: the run folders that failing-worker tests keep
    on purpose, and whatever torch writes, go where pytest prunes old sessions, not into /tmp forever."""
    folder = tmp_path_factory.getbasetemp() / "tmp"
    folder.mkdir(exist_ok=True)
    old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = str(folder)
    yield
    tempfile.tempdir = old_dir
    if old_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old_env
