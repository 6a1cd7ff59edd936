"""The tiled-MLP lever of issue 43, outside the fine-tune command: the 1B Llama shape with LoRA
r16 on the 7 projections, steadytrain's offloaded checkpointing and fused loss, each Llama MLP run
over 8,192 tokens at a time under its own checkpoint (the saver memory/tiled_mlp.py, which this
lever became; bench/long_context.py's ours-tiled arm runs it through the fine-tune command), one
forward and backward at 65,536 (twice), 98,304 and 131,072 tokens under a 16 GiB cap: peak and
tokens/s.

    python3 bench/long_context_lever.py        # GPU only; printed, no JSON
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from steadytrain.memory.chunked_loss import CausalLMLoss
    from steadytrain.memory.savers import MemorySavers
    from steadytrain.memory.tiled_mlp import set_tiling

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS)
    model = get_peft_model(model, lora)
    model.train()
    loss_fn = CausalLMLoss(1024)
    MemorySavers(model, loss_fn, checkpointing="auto", discrete_memory=True).set_checkpointing(
        "offload"
    )
    set_tiling(model, 8192)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(16 * GiB / total)
    for seq in (65536, 65536, 98304, 131072):
        ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_sum, count = loss_fn(model, {"input_ids": ids, "labels": ids})
            (loss_sum / count).backward()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            peak = torch.cuda.max_memory_allocated() / GiB
            print(
                f"tiled seq {seq}: peak {peak:.2f} GiB, {seconds:.2f}s, {seq / seconds:,.0f} tokens/s"
            )
        except torch.OutOfMemoryError as exc:
            print(f"tiled seq {seq}: out of memory ({str(exc)[:80]})")
        for param in model.parameters():
            param.grad = None
        del ids


if __name__ == "__main__":
    main()
