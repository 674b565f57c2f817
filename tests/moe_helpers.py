"""Shared pieces of the MoE tests: a small config and gradients in one layout whatever the experts class."""

from ds_megatron.models import GPTConfig
from ds_megatron.tensor_parallel import grad_of

MOE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, seq_length=8, vocab_size=64,
           hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8, num_experts=4,
           moe_router_topk=2)


def moe_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**MOE, **overrides})


def expert_grads(experts):
    """{(global expert, name): grad} in SequentialMLP's layout (fc1 [ffn/etp, h], fc2 [h, ffn/etp]);
    the gradient buffer's ``main_grad`` when one owns the gradients."""
    out = {}
    for local, e in enumerate(experts.local_expert_indices):
        if hasattr(experts, "weight1"):
            out[(e, "fc1")] = grad_of(experts.weight1)[local].t()
            out[(e, "fc2")] = grad_of(experts.weight2)[local].t()
        else:
            out[(e, "fc1")] = grad_of(experts.local_experts[local].linear_fc1.weight)
            out[(e, "fc2")] = grad_of(experts.local_experts[local].linear_fc2.weight)
    return out
