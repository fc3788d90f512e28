"""A descriptor's shm address is not trusted (issue 36, point 6).

The prefill worker maps the directory a descriptor names. A directory planted to look like a pool,
with a link in it, once had the mapping follow the link and write KV bytes over (and extend) the
file it points to. Only a directory directly under the shared-memory root, named as the project
names pools, owned by this user with mode 0700, holding regular files of the right sizes, is
mapped; anything else is refused with a logged reason, and the prefill side falls back to another
transport.
"""
import json
import logging
import os

import pytest
import torch

from splitserve.kvtransfer.base import TransportUnavailableError
from splitserve.kvtransfer.transports.shm import ShmSender, create_shared_pool

SHAPE = [2, 2, 4, 8, 2, 16]  # layers, K/V, blocks, block size, kv heads, head size
POOL_BYTES = 2 * 2 * 4 * 8 * 2 * 16 * 4


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("a file a link may point at")
    return path


def planted(root, victim, name="splitserve-kv-1-0badf00d", mode=0o700, meta=None, link="pool"):
    """A directory that looks like a pool, with ``link`` a symlink to ``victim``."""
    directory = root / name
    directory.mkdir(mode=mode)
    os.chmod(directory, mode)
    (directory / "meta.json").write_text(json.dumps(meta or {"shape": SHAPE, "dtype": "float32"}))
    for file, size in (("pool", POOL_BYTES), ("owners", SHAPE[2] * 8)):
        if file == link:
            os.symlink(victim, directory / file)
        else:
            (directory / file).write_bytes(bytes(size))
    return directory


def src_pool():
    return torch.zeros(SHAPE)


def refused(address, caplog, why):
    with caplog.at_level(logging.WARNING, logger="splitserve.kvtransfer.transports.shm"):
        with pytest.raises(TransportUnavailableError, match="refused"):
            ShmSender(str(address), src_pool())
    assert why in caplog.text, caplog.text


@pytest.mark.parametrize("link", ["pool", "owners"])
def test_a_link_in_the_directory_is_not_followed(private_shm, victim, caplog, link):
    before = victim.read_bytes()
    refused(planted(private_shm, victim, link=link), caplog, f"{link}:")
    assert victim.read_bytes() == before  # neither written nor extended


def test_a_directory_that_is_a_link_is_refused(private_shm, victim, caplog, tmp_path):
    real = planted(tmp_path, victim, link="none")
    os.symlink(real, private_shm / "splitserve-kv-2-0badf00d")
    refused(private_shm / "splitserve-kv-2-0badf00d", caplog, "a link or not a directory")


@pytest.mark.parametrize("where", ["outside", "badname", "dotdot"])
def test_only_pool_directories_under_the_shm_root(private_shm, victim, caplog, tmp_path, where):
    if where == "outside":
        address = planted(tmp_path, victim, link="none")
    elif where == "badname":
        address = planted(private_shm, victim, name="my-kv-pool", link="none")
    else:
        planted(tmp_path, victim, link="none")
        address = f"{private_shm}/../{tmp_path.relative_to('/')}/splitserve-kv-1-0badf00d"
    refused(address, caplog, "not a pool directory")


def test_another_users_or_an_open_directory_is_refused(private_shm, victim, caplog):
    refused(planted(private_shm, victim, name="splitserve-kv-3-0badf00d", mode=0o755, link="none"), caplog,
            "mode 755")
    theirs = planted(private_shm, victim, name="splitserve-kv-4-0badf00d", link="none")
    os.chown(theirs, 12345, 12345)
    refused(theirs, caplog, "uid 12345")


@pytest.mark.parametrize("meta, why", [({"shape": SHAPE, "dtype": "save"}, "does not describe a KV pool"),
                                       ({"shape": [1, 2], "dtype": "float32"}, "does not describe a KV pool"),
                                       ({"shape": [2, 2, 400, 8, 2, 16], "dtype": "float32"}, "bytes, not")])
def test_metadata_that_does_not_match_the_files_is_refused(private_shm, victim, caplog, meta, why):
    refused(planted(private_shm, victim, meta=meta, link="none"), caplog, why)


def test_a_real_pool_is_mapped(private_shm):
    pool, owners, directory = create_shared_pool(SHAPE, torch.float32)
    pool.fill_(5.0)
    sender = ShmSender(str(directory), src_pool())
    try:
        assert bool((sender.dst_pool == 5.0).all()) and sender.owners.numel() == SHAPE[2]
    finally:
        sender.close()


def test_the_prefill_worker_falls_back_and_says_why(tiny_model_dirs, private_shm, victim, caplog, hf_reference):
    """A descriptor naming a planted directory: the handoff goes over tcp, the link's target is untouched."""
    import dataclasses

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.worker.wiring import build_decode, build_prefill
    model = tiny_model_dirs["llama"]
    make = lambda: EngineConfig(model=str(model), dtype="float32", enforce_eager=True, num_gpu_blocks=64,  # noqa
                                block_size=8)
    decode, prefill = build_decode(make(), "auto"), build_prefill(make())
    before = victim.read_bytes()
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        prompt = list(range(3, 23))
        desc = decode.reserve("r", len(prompt))
        hostile = dataclasses.replace(desc, address=str(planted(private_shm, victim)))
        with caplog.at_level(logging.WARNING):
            prefill.start("r", prompt, greedy, hostile)
            [result] = prefill.step()
        assert result.error is None and result.transport == "tcp"
        assert "refused" in caplog.text and "falls back to tcp" in caplog.text
        out = decode.complete("r", result.epoch, prompt, greedy, result.first_token)
        while not out.finished:
            [out] = decode.engine.step()
        assert out.token_ids == hf_reference(model).greedy(prompt, 4)
        assert victim.read_bytes() == before
    finally:
        prefill.close()
        decode.close()
