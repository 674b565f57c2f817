"""A small MoE layer with Megatron-LM's step split, implementing ``BaseMoELayer`` (test double).

Routes top-k over softmax scores, permutes token copies expert-major with a
static count (tokens x topk, no dropping), keeps split sizes as device
tensors in its preprocess state and copies them to the host only at
``cuda_sync_point``, so it behaves like the real dispatchers for the
partial-capture control flow.  ``calls`` counts how often each step computed.
"""
from collections import Counter

import torch

from ds_megatron.moe.moe_layer import BaseMoELayer


class ToyDispatcher:
    PREPROCESS_STATE = ("routing_map", "tokens_per_expert", "reversed_local_input_permutation_mapping")

    def __init__(self, num_experts, topk):
        self.num_experts, self.topk = num_experts, topk
        self.cuda_sync_point = "before_permutation_1"
        self.host_tokens_per_expert = None
        self.sync_points_seen = []

    def preprocess_state(self):
        return {name: getattr(self, name) for name in self.PREPROCESS_STATE}

    def restore_preprocess_state(self, state):
        for name, value in state.items():
            setattr(self, name, value)
        self.host_tokens_per_expert = None  # the host copy belongs to the previous micro-batch

    def _maybe_dtoh(self, point):
        if point == self.cuda_sync_point and self.host_tokens_per_expert is None:
            self.sync_points_seen.append(point)
            self.host_tokens_per_expert = self.tokens_per_expert.tolist()

    def dispatch_preprocess(self, tokens, routing_map, probs):
        self.routing_map = routing_map
        self.tokens_per_expert = routing_map.sum(dim=0)
        self.host_tokens_per_expert = None
        self._maybe_dtoh("before_permutation_1")
        num_tokens = routing_map.size(0)
        flat = routing_map.t().reshape(-1)
        # Static count (no dropping): a stable sort puts the selected copies first, expert-major.
        order = torch.sort(flat.to(torch.int8), descending=True, stable=True).indices[:num_tokens * self.topk]
        self.reversed_local_input_permutation_mapping = order % num_tokens
        permuted = tokens.index_select(0, self.reversed_local_input_permutation_mapping)
        permuted_probs = probs.t().reshape(-1).index_select(0, order)
        return permuted, permuted_probs

    def token_dispatch(self, hidden, probs):
        self._maybe_dtoh("before_ep_alltoall")  # the EP all-to-all would need host split sizes here
        return hidden, probs

    def combine(self, expert_output, num_tokens):
        out = torch.zeros(num_tokens, expert_output.size(-1), dtype=expert_output.dtype, device=expert_output.device)
        return out.index_add(0, self.reversed_local_input_permutation_mapping, expert_output)


class ToyMoE(BaseMoELayer):
    def __init__(self, hidden, num_experts=4, topk=2, ffn=8, shared_expert=False, z_loss=0.0):
        super().__init__()
        self.router = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(),
                                                               torch.nn.Linear(ffn, hidden))
                                           for _ in range(num_experts))
        self.shared_experts = torch.nn.Linear(hidden, hidden) if shared_expert else None
        self.topk = topk
        self.z_loss = z_loss
        self.token_dispatcher = ToyDispatcher(num_experts, topk)
        self.calls = Counter()
        self._aux_losses = {}

    @property
    def aux_losses(self):
        return self._aux_losses

    def shared_experts_compute(self, hidden_states):
        self.calls["shared_experts_compute"] += 1
        return None if self.shared_experts is None else self.shared_experts(hidden_states)

    def route(self, hidden_states):
        self.calls["route"] += 1
        logits = self.router(hidden_states.reshape(-1, hidden_states.size(-1)))
        scores = torch.softmax(logits, dim=-1)
        top, idx = scores.topk(self.topk, dim=-1)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
        probs = torch.zeros_like(scores).scatter(1, idx, top)
        self._aux_losses = {"z_loss": self.z_loss * torch.logsumexp(logits, -1).pow(2).mean()} if self.z_loss else {}
        return probs, routing_map

    def restore_route(self, aux_losses):
        self.calls["restore_route"] += 1
        self._aux_losses = dict(aux_losses)

    def preprocess(self, hidden_states, probs, routing_map):
        self.calls["preprocess"] += 1
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_states.size(-1))
        return self.token_dispatcher.dispatch_preprocess(tokens, routing_map, probs)

    def dispatch(self, hidden, probs):
        self.calls["rest"] += 1
        return self.token_dispatcher.token_dispatch(hidden, probs)

    def routed_experts_compute(self, hidden, probs):
        sizes = self.token_dispatcher.host_tokens_per_expert
        outs = [expert(chunk) for expert, chunk in zip(self.experts, torch.split(hidden, sizes))]
        return torch.cat(outs) * probs.unsqueeze(-1)

    def combine(self, output, shared_expert_output):
        out = self.token_dispatcher.combine(output, self.hidden_shape.numel() // self.hidden_shape[-1])
        out = out.reshape(self.hidden_shape)
        return out if shared_expert_output is None else out + shared_expert_output
