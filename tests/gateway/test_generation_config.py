"""``--generation-config``: which sampling defaults a gateway takes from a model's
``generation_config.json`` (vLLM's rule and names), and a gateway that refuses to start on a
file it cannot use. What a request then gets is in ``test_wire`` and, through a running stack,
``tests/service/test_openai_http.py``."""
import json

import pytest

from splitserve.engine.model_files import sampling_defaults
from splitserve.gateway.server import generation_defaults


def write(directory, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **fields}))
    return directory


def test_the_files_sampling_fields_by_request_name(tmp_path):
    model = write(tmp_path / "m", temperature=0.6, top_p=0.9, top_k=None, max_new_tokens=64, do_sample=True,
                  max_length=4096)
    # Only the fields vLLM takes; null ones and generation-length fields of other meaning are left out.
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert sampling_defaults(tmp_path / "no-such-dir") == {}


def test_auto_vllm_or_a_directory(tmp_path):
    model = write(tmp_path / "model", temperature=0.6, min_p=0.05, repetition_penalty=1.05)
    other = write(tmp_path / "other", top_k=20)
    assert generation_defaults("auto", model) == {"temperature": 0.6, "min_p": 0.05, "repetition_penalty": 1.05}
    assert generation_defaults("vllm", model) == {}
    assert generation_defaults(str(other), model) == {"top_k": 20}
    assert generation_defaults("auto", tmp_path / "without-a-file") == {}


def test_a_file_it_cannot_use_stops_the_gateway_naming_it(tmp_path):
    model = write(tmp_path / "model", temperature=0.6)
    with pytest.raises(SystemExit, match="--generation-config .*missing: no generation_config.json there"):
        generation_defaults(str(tmp_path / "missing"), model)
    bad = write(tmp_path / "bad", top_p=1.5)
    with pytest.raises(SystemExit, match=r"bad/generation_config.json: top_p .*--generation-config vllm"):
        generation_defaults("auto", bad)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "generation_config.json").write_text("{not json")
    with pytest.raises(SystemExit, match="broken/generation_config.json"):
        generation_defaults("auto", broken)
