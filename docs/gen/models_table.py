"""The tables of docs/models.md, generated from the engine's registry when the site is built
(mkdocs-gen-files): every architecture the engine serves (``SUPPORTED``), each tested against
``transformers`` by ``tests/test_model_families.py``, and the ones it refuses with why
(``REFUSED``). The result replaces the marker line, so the page cannot drift from the registry:
change ``splitserve/engine/model_registry.py``.

    python docs/gen/models_table.py      # prints the generated Markdown
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from markdown_text import one_line  # noqa: E402

PAGE = "models.md"
MARKER = "<!-- generated: models -->"


# The architectures tests/test_quantized_checkpoints.py serves from quantized checkpoints, and in
# which formats.
CHECKPOINTS_TESTED = {
    "LlamaForCausalLM": "GGUF (Q4_0, Q4_1, Q8_0, Q4_K_M), GPTQ (4/8-bit, act-order), AWQ, FP8 (tensor, block)",
    "Qwen2ForCausalLM": "GGUF (tied output), GPTQ, AWQ, compressed-tensors (W4A16, W8A16, W8A8, FP8)",
}


def render() -> str:
    from splitserve.engine.model_registry import REFUSED, SUPPORTED

    out = ["<!-- Generated from splitserve/engine/model_registry.py by docs/gen/models_table.py when the site "
           "is built. -->", "",
           "### Served", "",
           "| architecture | family | an example checkpoint | beyond a Llama-style decoder | `--quantization int8`, `fp8` "
           "at load | quantized checkpoints tested | tested on |",
           "|---|---|---|---|---|---|---|"]
    for name, arch in sorted(SUPPORTED.items(), key=lambda item: item[1].family.lower()):
        quantized = "linears; experts stay float" if arch.experts else "every linear"
        checkpoints = CHECKPOINTS_TESTED.get(name, "— (the readers are generic; not tested)")
        out.append(f"| `{name}` | {one_line(arch.family)} | `{arch.example}` | {one_line(arch.features) or '—'} | "
                   f"{quantized} | {checkpoints} | CPU (fp32, tiny random model) |")
    out += ["", "### Refused, with the reason given", "",
            "| architecture | what it needs that the engine does not implement |", "|---|---|"]
    for name, reason in sorted(REFUSED.items()):
        out.append(f"| `{name}` | {one_line(reason)} |")
    return "\n".join(out)


def main() -> None:
    import mkdocs_gen_files
    with mkdocs_gen_files.open(PAGE, "r+") as page:
        text = page.read()
        if MARKER not in text:
            raise SystemExit(f"docs/{PAGE} has no line {MARKER!r} to put the models tables at")
        page.seek(0)
        page.write(text.replace(MARKER, render()))
        page.truncate()


if __name__ == "__main__":
    print(render())
else:  # run by mkdocs-gen-files
    main()
