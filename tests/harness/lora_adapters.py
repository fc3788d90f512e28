"""LoRA adapters made with PEFT for the tests, and the merged models that are their reference."""
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, out_dir: Path, seed: int, **lora) -> tuple[Path, Path]:
    """A PEFT adapter of ``base_dir`` with random A and B (PEFT starts B at zero: an adapter that
    changes nothing), saved as PEFT saves it, and the model PEFT merges from it (the reference);
    ``lora``: ``LoraConfig``'s arguments. Returns (adapter dir, merged model dir)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "merged" / "config.json").exists():
        return out_dir / "adapter", out_dir / "merged"
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32),
                           LoraConfig(**lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out_dir / "adapter")
    model.merge_and_unload().save_pretrained(out_dir / "merged")
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir / "merged")
    return out_dir / "adapter", out_dir / "merged"
