"""Mixture-of-experts MLPs: a router picks each token's experts, each expert is a gated MLP of
its own, and a token's output is its experts' outputs weighted by the router (plus a shared
expert every token runs, where the model has one). Written once for every MoE family
(``models/moe_families.py``); the family names the tensors, the config the shapes and the
routing (``ModelArchConfig.num_experts`` and the fields after it).

Routing (transformers' order of operations): router logits ``x . W_r`` (float32; plus a bias,
gpt-oss); then "softmax_topk" (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax over all experts, the top
``k`` by probability (ties to the lower id, as ``torch.topk``), renormalised to sum to 1 where
``norm_topk_prob``; or "topk_softmax" (gpt-oss): the top ``k`` logits, a softmax over them.

An expert is ``down(glu(gate_up(x) + b_gu)) + b_d`` (the biases gpt-oss's, where the arch has
them), its GLU the family's activation or gpt-oss's clamped SwiGLU (``swiglu_clamped``).

Computation, grouped by expert: the step's rows are sorted by the experts they chose, and
each expert with rows runs once over all of them (its weights read once a step: a prefill's
rows share the reads, a decode reads only its chosen experts). Each row's result is added
into the output expert by expert in ascending id, the order transformers adds them in.

Batch invariance: a row's experts and their weights depend on the row alone (its router
logits are ``float_mm``'s, a fixed order of operations per output), every expert's matmuls
are ``float_mm``'s (a row's bits do not depend on the other rows it is computed with), and
its sum runs in a fixed order: a token's output does not depend on its neighbours.

Experts of a GGUF's block types run stacked (``models/expert_stack.py``): each projection of
every expert in one kernel pass, each row with the arithmetic of its expert's own ``mm``, and
the rows added in the same order, so the stacked and the one-by-one paths give the same bits.

Weights: float (``quantization="none"`` or an HF checkpoint in its dtype), each expert's held
transposed like the dense layers' (``[in, out]``), stacked: ``gate_up`` ``(E, hidden, 2 *
inter)`` [gate | up], ``down`` ``(E, inter, hidden)``; or, after ``install_quantized``
(``quantization`` "int4" / "int8" of an HF checkpoint), one quantized weight per expert and
projection (``models/quant.py``: int4 on kvwise's ``q4mm``, whose int8 activations are
quantized per row, so the rows stay independent), the router float; or a GGUF's experts at
the file's own block types (``install_experts``: Q4_K, Q6_K, ... on their kernels, which
quantize activations per row as well).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from kvwise.models.arch import ModelArchConfig
from kvwise.models.expert_stack import ExpertStack, stack_experts
from kvwise.models.linear import Linear, float_mm, param

Glu = Callable[[torch.Tensor, int], torch.Tensor]  # (T, 2 * inter) -> (T, inter)


class MoEWeights(nn.Module):
    """One layer's experts, router and shared expert (see the module docstring)."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        num, hidden, inter = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        shared = arch.shared_expert_intermediate_size
        self.num_experts, self.top_k, self.inter = num, arch.num_experts_per_tok, inter
        self.norm_topk_prob, self.routing = arch.norm_topk_prob, arch.routing
        self.router = param(hidden, num, dtype=dtype)  # [in, experts]
        self.router_bias = param(num, dtype=dtype) if arch.router_bias else None
        self.n_group, self.topk_group = arch.n_group, arch.topk_group
        self.routed_scaling_factor = arch.routed_scaling_factor
        # "sigmoid_topk"'s bias on the scores that choose (DeepSeek-V3's e_score_correction_bias)
        self.correction_bias = (
            param(num, dtype=torch.float32) if arch.router_correction_bias else None
        )
        bias = arch.expert_bias  # float parameters whatever the experts' format
        self.gate_up_bias = param(num, 2 * inter, dtype=dtype) if bias else None  # [gate | up]
        self.down_bias = param(num, hidden, dtype=dtype) if bias else None
        self.glu: Glu | None = None  # None: the family's (forward's argument)
        if arch.expert_glu == "swiglu_clamped":
            self.glu = functools.partial(
                swiglu_clamped, alpha=arch.swiglu_alpha, limit=arch.swiglu_limit
            )
        self.gate_up = param(num, hidden, 2 * inter, dtype=dtype)  # each [in, gate | up]
        self.down = param(num, inter, hidden, dtype=dtype)  # each [in, out]
        self.shared_inter = shared
        self.shared_gate_up = param(hidden, 2 * shared, dtype=dtype) if shared else None
        self.shared_down = param(shared, hidden, dtype=dtype) if shared else None
        self.shared_gate = param(hidden, 1, dtype=dtype) if arch.shared_expert_gate else None
        # (gate_up, down) of each expert, then of the shared one, once quantized
        self.quant: list[tuple[Linear, Linear]] | None = None
        # the experts' gate_up and down as stacks, where they are block weights of one type
        self.stacks: tuple[ExpertStack, ExpertStack] | None = None

    def install_quantized(self, quantize: Callable[[torch.Tensor], Linear]) -> None:
        """Quantize every expert's projections and the shared expert's (``quantize`` takes a
        float ``(out, in)`` weight); their float parameters go, the router stays float."""
        pairs = [(self.gate_up[e], self.down[e]) for e in range(self.num_experts)]
        if self.shared_gate_up is not None:
            pairs.append((self.shared_gate_up, self.shared_down))
        self.install_experts([(quantize(gu.t()), quantize(d.t())) for gu, d in pairs])

    def install_experts(
        self,
        pairs: list[tuple[Linear, Linear]],
        stacks: tuple[ExpertStack, ExpertStack] | None = None,
    ) -> None:
        """Run on ``pairs`` (gate_up, down) of weights with ``mm``: each expert's, then the
        shared expert's where the layer has one (a GGUF's experts at their own types,
        ``models/gguf_load.py``); the float parameters go, the router stays float. ``stacks``:
        the routed experts' weights already stacked (``pairs`` then holds their views), else
        stacked here where they can be.

        Raises:
            ValueError: a pair missing or of the wrong shape, naming the expert.
        """
        widths = [self.inter] * self.num_experts + (
            [self.shared_inter] if self.shared_inter else []
        )
        if len(pairs) != len(widths):
            raise ValueError(f"weights: {len(pairs)} expert weight pairs, expected {len(widths)}")
        hidden = self.router.shape[0]
        for e, ((gate_up, down), inter) in enumerate(zip(pairs, widths, strict=True)):
            got = (gate_up.out_features, gate_up.in_features, down.out_features, down.in_features)
            if got != (2 * inter, hidden, hidden, inter):
                raise ValueError(
                    f"weights: expert {e}'s gate_up / down are {got[0]}x{got[1]} / "
                    f"{got[2]}x{got[3]}, expected {2 * inter}x{hidden} / {hidden}x{inter}"
                )
        self.quant = list(pairs)
        self.gate_up = self.down = self.shared_gate_up = self.shared_down = None
        experts = pairs[: self.num_experts]
        gate_up, down = stacks or (stack_experts([pair[i] for pair in experts]) for i in (0, 1))
        if gate_up is not None and down is not None:  # each expert's weights: views of them
            self.stacks = (gate_up, down)
            self.quant[: self.num_experts] = [
                (gate_up.expert(e), down.expert(e)) for e in range(self.num_experts)
            ]

    def routed_nbytes(self) -> int:
        """Bytes of the routed experts' weights (not the router's, the shared expert's, the
        biases'): a decode step reads ``top_k / num_experts`` of them."""
        if self.quant is not None:
            return sum(w.nbytes for pair in self.quant[: self.num_experts] for w in pair)
        return self.gate_up.nbytes + self.down.nbytes

    def nbytes_quantized(self) -> int:
        """Bytes the quantized experts take (0 while they are float parameters)."""
        return sum(w.nbytes for pair in self.quant or () for w in pair)

    def _expert(self, x: torch.Tensor, e: int, glu: Glu, inter: int) -> torch.Tensor:
        """Expert ``e``'s MLP over rows ``x`` (``e == num_experts``: the shared one)."""
        routed = e if e < self.num_experts else None  # the shared expert has no biases
        if self.quant is not None:
            gate_up, down = self.quant[e]
            h = self._bias(gate_up.mm(x).to(x.dtype), self.gate_up_bias, routed)
            return self._bias(down.mm(glu(h, inter)).to(x.dtype), self.down_bias, routed)
        if routed is None:
            return float_mm(glu(float_mm(x, self.shared_gate_up), inter), self.shared_down)
        h = self._bias(float_mm(x, self.gate_up[e]), self.gate_up_bias, e)
        return self._bias(float_mm(glu(h, inter), self.down[e]), self.down_bias, e)

    @staticmethod
    def _bias(y: torch.Tensor, bias: torch.Tensor | None, e) -> torch.Tensor:
        """``y`` plus expert ``e``'s row of ``bias`` (``e`` a tensor: each row's expert's);
        ``y`` as it is without a bias (or for the shared expert, ``e`` None)."""
        return y if bias is None or e is None else y.add_(bias[e])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts ``(T, k)`` long and their weights ``(T, k)`` (x's dtype)."""
        logits = float_mm(x, self.router).float()  # (T, E)
        if self.router_bias is not None:
            logits = logits + self.router_bias.float()
        if self.routing == "topk_softmax":  # the top k logits, then a softmax over them
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1).to(x.dtype)
        if self.routing == "sigmoid_topk":
            scores = torch.sigmoid(logits)
            choice = scores if self.correction_bias is None else scores + self.correction_bias
            chosen = self._in_best_groups(choice, best=2, fill=float("-inf"))
            ids = torch.topk(chosen, self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            probs = torch.softmax(logits, dim=-1)
            chosen = self._in_best_groups(probs, best=1, fill=0.0)
            weights, ids = torch.topk(chosen, self.top_k, dim=-1)
        if self.norm_topk_prob:
            eps = 1e-20 if self.routing == "sigmoid_topk" else 0.0  # as transformers adds
            weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        return ids, (weights * self.routed_scaling_factor).to(x.dtype)

    def _in_best_groups(self, scores: torch.Tensor, best: int, fill: float) -> torch.Tensor:
        """``scores`` ``(T, E)`` with every expert outside each row's ``topk_group`` best
        groups set to ``fill`` (a group scored by its ``best`` highest scores' sum), as
        transformers' DeepSeek routers do (V2: best 1, fill 0; V3: best 2, fill -inf)."""
        if self.n_group == 1:
            return scores
        grouped = scores.view(scores.shape[0], self.n_group, -1)  # (T, groups, E / groups)
        group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)  # (T, groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, self.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], fill).view_as(scores)

    def forward(self, x: torch.Tensor, glu: Glu) -> torch.Tensor:
        """``x`` ``(T, hidden)``, normed -> the MLP's output ``(T, hidden)``."""
        glu = self.glu or glu
        ids, weights = self.route(x)
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)  # (T * k,): row r's choices at r * k .. r * k + k - 1
        order = torch.argsort(flat, stable=True)  # choices grouped by expert, rows ascending
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows, picked = order // self.top_k, weights.reshape(-1)[order]
        if self.stacks is not None:  # every expert's rows in one kernel pass a projection
            offsets = torch.zeros(self.num_experts + 1, dtype=torch.long)
            torch.cumsum(counts, 0, out=offsets[1:])
            gate_up, down, experts = *self.stacks, flat[order]
            h = self._bias(gate_up.mm(x[rows], offsets).to(x.dtype), self.gate_up_bias, experts)
            y = self._bias(
                down.mm(glu(h, self.inter), offsets).to(x.dtype), self.down_bias, experts
            )
            out.index_add_(0, rows, y * picked[:, None])
        else:
            start = 0
            for expert, count in enumerate(counts.tolist()):
                if not count:
                    continue
                at, w = rows[start : start + count], picked[start : start + count, None]
                out.index_add_(0, at, self._expert(x[at], expert, glu, self.inter) * w)
                start += count
        if self.shared_inter:
            shared = self._expert(x, self.num_experts, glu, self.shared_inter)
            if self.shared_gate is not None:
                shared = torch.sigmoid(float_mm(x, self.shared_gate)) * shared
            out = out + shared
        return out


def swiglu_clamped(gate_up: torch.Tensor, inter: int, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's GLU: `(T, 2 * inter)` [gate | up] -> `(T, inter)`,
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``
    (transformers' ``GptOssExperts._apply_gate``, its gate and up de-interleaved)."""
    gate = gate_up[:, :inter].clamp(max=limit)
    up = gate_up[:, inter:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
