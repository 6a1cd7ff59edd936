"""What each rank of a sharded run holds, in bytes: a tiny Llama (full fine-tune, fp32, AdamW)
sharded as a run shards it (engine/sharding.py `shard`), one optimizer step of two micro-batches
with the gradient sync off in the first, as the run's step does (engine/agreement.py).

    python -m torch.distributed.run --nproc_per_node 2 fsdp_state.py OUT_DIR

Every rank writes OUT_DIR/rank-R.json: the bytes of the storages behind its parameters, its
gradients and its optimizer state (AdamW's two moments), and of the unsharded gradients it holds
between the two micro-batches. tests/test_estimate_ranks.py compares them with the estimate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from steadytrain.engine.distributed import Group
from steadytrain.engine.sharding import set_gradient_sync, shard

VOCAB, LENGTH = 257, 8


def config():
    """The shape the test estimates: odd first dimensions (the vocabulary, the MLP) so that
    FSDP2's padding shows."""
    from transformers import LlamaConfig

    found = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=171,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
    )
    found._attn_implementation = "sdpa"
    return found


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts its whole buffer)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_gradients(model) -> int:
    """Bytes of the unsharded gradients FSDP2 keeps between micro-batches (gradient sync off)."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group else ():
            grad = param._unsharded_param.grad
            if grad is None:
                grad = param.unsharded_accumulated_grad
            total += 0 if grad is None else grad.numel() * grad.element_size()
    return total


def main(out: Path) -> None:
    from transformers import LlamaForCausalLM

    group = Group.from_env()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    shard(model, group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(group.rank))
    set_gradient_sync(model, False)
    model(input_ids=ids[:1], labels=ids[:1]).loss.backward()
    held = held_gradients(model)
    set_gradient_sync(model, True)
    model(input_ids=ids[1:], labels=ids[1:]).loss.backward()
    optimizer.step()
    params = list(model.parameters())
    states = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    found = {
        "weights": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params),
        "states": storage_bytes(states),
        "held": held,
    }
    (out / f"rank-{group.rank}.json").write_text(json.dumps(found))
    group.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
