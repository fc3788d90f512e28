"""The admin side of LoRA adapters, without workers: who may load, and --lora-modules' syntax."""
import asyncio

import pytest

from splitserve.common.errors import InvalidArgument, PermissionDenied
from splitserve.gateway.lora_admin import LoRAAdmin
from splitserve.worker.serve import lora_modules


class NoWorkers:
    """A dispatcher whose any use is a failure: a refused call must not reach the workers."""

    def __getattr__(self, name):
        raise AssertionError(f"the dispatcher was used ({name}) by a call that should have been refused")


def test_only_the_admin_loads_or_unloads():
    admin = LoRAAdmin(NoWorkers(), ledger=None)
    with pytest.raises(PermissionDenied, match="admin token"):
        asyncio.run(admin.load("a", "/adapters/a", admin=False))
    with pytest.raises(PermissionDenied, match="admin token"):
        asyncio.run(admin.unload("a", admin=False))
    with pytest.raises(InvalidArgument, match="lora_name and lora_path are required"):
        asyncio.run(admin.load("a", "", admin=True))


def test_lora_modules_parse_name_path_pairs():
    assert lora_modules("") == []
    assert lora_modules("sql=/a/sql, chat=/a/chat ,") == [("sql", "/a/sql"), ("chat", "/a/chat")]
    for bad in ("sql", "=/a/sql", "sql="):
        with pytest.raises(SystemExit, match="is not name=path"):
            lora_modules(bad)
