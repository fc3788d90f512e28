"""Quantized checkpoints written the way each format's own tools lay them out (GGUF by llama.cpp's
converter and ``gguf``'s quantizers; GPTQ by AutoGPTQ; AWQ by AutoAWQ; compressed-tensors by its own
compressors; FP8 as vLLM and transformers read it), each with a reference checkpoint: the float
model holding the weights the codes stand for, as the format's own de-quantizer gives them back.

Used by tests/test_quantized_checkpoints.py and bench/quantization.py.
"""
from __future__ import annotations

import json

import numpy as np
import torch
import transformers

def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute): q/k rows reordered from
    Hugging Face's rotary halves to interleaved pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def random_k_blocks(rows: int, cols: int, gguf_type: str, seed: int = 0) -> np.ndarray:
    """Q4_K or Q6_K super-blocks for a [rows, cols] weight with random codes and sub-block scales
    (``gguf`` has no quantizer for them; any bytes are valid blocks but for the fp16 factors, set
    here so the weights have a spread like a trained model's, |w| up to ~0.5)."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q6_K": 210}[gguf_type]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    if gguf_type == "Q4_K":  # w = d sc q - dmin m, sc and m 0..63, q 0..15
        blocks[..., 0:2] = np.full((rows, cols // 256, 1), 0.0005, np.float16).view(np.uint8)
        blocks[..., 2:4] = np.full((rows, cols // 256, 1), 0.004, np.float16).view(np.uint8)
    else:  # w = d sc (q - 32), sc int8, q 0..63
        blocks[..., 208:210] = np.full((rows, cols // 256, 1), 0.0001, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(model_dir, out_dir, types: dict[str, str], arch: str = "llama"):
    """model_dir's checkpoint as a GGUF file in out_dir (beside its config and tokenizer), each 2-D
    weight in ``types[role]``: role "embedding", "linear", or a part of the tensor's GGUF name
    (``attn_v``, ``output.``), which wins (F32 for the rest). Q4_K/Q6_K tensors get random blocks.
    Returns out_dir and the reference checkpoint: the float model with each quantized weight as
    gguf de-quantizes it."""
    import gguf
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    out_dir.mkdir(parents=True)
    writer = gguf.GGUFWriter(str(out_dir / "model.gguf"), arch)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    reference = {}
    for name, param in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        value = param.numpy().astype(np.float32)
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")) and arch == "llama":
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        role = next((part for part in types if part not in ("embedding", "linear") and part in gguf_name),
                    "embedding" if gguf_name.startswith("token_embd") else "linear")
        qtype = gguf.GGMLQuantizationType[types[role]] if value.ndim == 2 else gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, value)
            continue
        if qtype.name in ("Q4_K", "Q6_K"):
            blocks = random_k_blocks(*value.shape, qtype.name, seed=len(reference))
        else:
            blocks = gguf.quantize(value, qtype)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        restored = torch.from_numpy(gguf.dequantize(blocks, qtype))
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")) and arch == "llama":
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            inverse = np.argsort(llama_cpp_permute(np.arange(value.shape[0]).reshape(-1, 1), heads)[:, 0])
            restored = restored[torch.from_numpy(inverse)]
        reference[name] = restored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config.save_pretrained(out_dir)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    # The oracle: untied (the engine's output projection reads the embedding's codes, as transformers'
    # reads the de-quantized table), every quantized weight as gguf restores it.
    ref_dir = out_dir.parent / f"{out_dir.name}-reference"
    with torch.no_grad():
        if tied:
            model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
            model.config.tie_word_embeddings = False
            if "model.embed_tokens.weight" in reference:
                reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
        for name, value in reference.items():
            model.get_parameter(name).copy_(value)
    model.save_pretrained(ref_dir)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(ref_dir)
    return out_dir, ref_dir


def decoder_linears(model):
    """(checkpoint name prefix, module) of each linear layer of the decoder layers: what the
    quantization tools quantize (embeddings and the output projection stay float)."""
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            yield f"model.layers.{name}", module


def float_rest(model, quantized: set[str]) -> dict:
    """The model's tensors that were not quantized (a tied output projection is not saved)."""
    return {name: param.detach().clone() for name, param in model.state_dict().items()
            if name not in quantized and not (name == "lm_head.weight" and model.config.tie_word_embeddings)}


def save_checkpoint(model_dir, out_dir, model, tensors: dict, quantization_config: dict):
    """Write ``tensors`` as out_dir's checkpoint (``model``'s config with ``quantization_config``,
    model_dir's tokenizer) and ``model`` (holding the weights the codes stand for) as the reference
    checkpoint beside it; returns both directories."""
    from safetensors.torch import save_file
    out_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    ref_dir = out_dir.parent / f"{out_dir.name}-reference"
    model.save_pretrained(ref_dir)
    for directory in (out_dir, ref_dir):
        transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(directory)
    return out_dir, ref_dir


def rtn_quantize(weight: torch.Tensor, bits: int, group: int, g_idx: torch.Tensor):
    """Round-to-nearest with a zero point, per (group, output channel) as GPTQ/AWQ checkpoints hold
    them: integer codes [in, out], zeros and 16-bit scales [groups, out], and the weight they stand
    for, scale * (code - zero), computed here from the integers (not from any packed form)."""
    qmax = 2 ** bits - 1
    w = weight.t()  # [in, out]
    groups = int(g_idx.max()) + 1
    lo = torch.stack([w[g_idx == g].amin(dim=0) for g in range(groups)]).clamp(max=0)
    hi = torch.stack([w[g_idx == g].amax(dim=0) for g in range(groups)]).clamp(min=0)
    scales = ((hi - lo) / qmax).clamp(min=1e-5).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, qmax).int()
    codes = torch.round(w / scales.float()[g_idx] + zeros[g_idx]).clamp(0, qmax).int()
    restored = (scales.float()[g_idx] * (codes - zeros[g_idx]).float()).t()
    return codes, zeros, scales, restored


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool):
    """AutoGPTQ's packing: qweight [in / p, out] with p codes of consecutive input channels per
    int32 (low bits first); qzeros [groups, out / p] the same along output channels, minus one (v1)."""
    per = 32 // bits
    qweight = torch.zeros(codes.shape[0] // per, codes.shape[1], dtype=torch.int64)
    for j in range(per):
        qweight |= codes[j::per].long() << (bits * j)
    stored = zeros.long() - (1 if v1 else 0)
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // per, dtype=torch.int64)
    for j in range(per):
        qzeros |= (stored[:, j::per] & (2 ** bits - 1)) << (bits * j)
    return as_int32(qweight), as_int32(qzeros)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 tensors checkpoints store."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_awq(values: torch.Tensor):
    """AutoAWQ's GEMM packing: 8 output channels per int32, nibble i holding channel (0, 2, 4, 6,
    1, 3, 5, 7)[i] of the eight."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, channel in enumerate(order):
        packed |= values[:, channel::8].long() << (4 * i)
    return as_int32(packed)


def write_packed(model_dir, out_dir, method: str, bits: int = 4, group: int = 32, act_order: bool = False,
                 v1: bool = True):
    """model_dir's checkpoint as a GPTQ or AWQ export (config.json's quantization_config, packed
    tensors in fp16 where the tools write fp16), and the reference checkpoint holding the weights
    those codes stand for."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors, written = {}, set()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for prefix, module in decoder_linears(model):
            in_features = module.in_features
            g_idx = torch.arange(in_features) // group
            if act_order:
                g_idx = g_idx[torch.randperm(in_features, generator=gen)]
            codes, zeros, scales, restored = rtn_quantize(module.weight, bits, group, g_idx)
            module.weight.copy_(restored)
            if method == "gptq":
                tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"] = pack_gptq(codes, zeros, bits, v1)
                tensors[f"{prefix}.g_idx"] = g_idx.int()
            else:
                tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"] = pack_awq(codes), pack_awq(zeros)
            tensors[f"{prefix}.scales"] = scales
            if module.bias is not None:
                tensors[f"{prefix}.bias"] = module.bias.detach().half()
                module.bias.copy_(module.bias.half().float())
            written |= {f"{prefix}.weight", f"{prefix}.bias"}
        tensors.update(float_rest(model, written))
    if method == "gptq":
        config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
                  "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        config = {"quant_method": "awq", "bits": bits, "group_size": group, "version": "gemm", "zero_point": True}
    return (*save_checkpoint(model_dir, out_dir, model, tensors, config), len(written) // 2)


def reduce_scales(weight: torch.Tensor, strategy: str, group: int | None, block: list[int] | None, how):
    """Per-tensor, channel, group or block min/max of a weight [out, in], shaped as the scales are."""
    out_features, in_features = weight.shape
    if strategy == "tensor":
        return how(weight.reshape(1, -1), dim=1).values
    if strategy == "channel":
        return how(weight, dim=1, keepdim=True).values
    if strategy == "group":
        return how(weight.reshape(out_features, in_features // group, group), dim=2).values
    rows, cols = block
    blocks = weight.reshape(out_features // rows, rows, in_features // cols, cols)
    return how(how(blocks, dim=3).values, dim=1).values


def write_compressed(model_dir, out_dir, preset: str, fmt: str, **weights_args):
    """model_dir's checkpoint as llm-compressor would write it with ``preset`` (one of
    compressed-tensors' preset schemes, its weight args overridden by ``weights_args``): scales from
    compressed-tensors' own ``calculate_qparams``, tensors from its own compressor for ``fmt``, and
    the reference checkpoint holding what its own decompressor gives back."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=weights_args)
    args = scheme.weights
    compressor = BaseCompressor.get_value_from_registry(fmt)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors, quantized = {}, set()
    with torch.no_grad():
        for prefix, module in decoder_linears(model):
            weight = module.weight.detach()
            lo = reduce_scales(weight, args.strategy, args.group_size, args.block_structure, torch.min)
            hi = reduce_scales(weight, args.strategy, args.group_size, args.block_structure, torch.max)
            scale, zero_point = calculate_qparams(lo, hi, args)
            state = {"weight": weight, "weight_scale": scale.float(), "weight_zero_point": zero_point}
            compressed = compressor.compress(state, scheme)
            restored = compressor.decompress(dict(compressed), scheme)["weight"]
            module.weight.copy_(restored.float())
            tensors.update({f"{prefix}.{k}": v for k, v in compressed.items()})
            quantized.add(f"{prefix}.weight")
        tensors.update(float_rest(model, quantized))
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head"]).model_dump(mode="json")
    return (*save_checkpoint(model_dir, out_dir, model, tensors, config), len(quantized))


def write_fp8(model_dir, out_dir, block: list[int] | None):
    """model_dir's checkpoint in the FP8 layout of ``quant_method: fp8`` (e4m3 weights; a
    ``weight_scale`` per tensor, or ``weight_scale_inv`` per block with ``weight_block_size``), and
    its reference: code * scale."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors, done = {}, set()
    with torch.no_grad():
        for prefix, module in decoder_linears(model):
            weight = module.weight.detach()
            if block is None:
                scale = weight.abs().amax() / 448.0
                codes = (weight / scale).to(torch.float8_e4m3fn)
                tensors[f"{prefix}.weight_scale"] = scale.reshape(())
                module.weight.copy_(codes.float() * scale)
            else:
                amax = reduce_scales(weight.abs(), "block", None, block, torch.max)
                scale = amax / 448.0
                full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
                codes = (weight / full).to(torch.float8_e4m3fn)
                tensors[f"{prefix}.weight_scale_inv"] = scale
                module.weight.copy_(codes.float() * full)
            tensors[f"{prefix}.weight"] = codes
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.05)  # static activations: not used here
            done.add(f"{prefix}.weight")
        tensors.update(float_rest(model, done))
    config = {"quant_method": "fp8", "activation_scheme": "static" if block is None else "dynamic",
              **({"weight_block_size": block} if block else {})}
    return save_checkpoint(model_dir, out_dir, model, tensors, config)
