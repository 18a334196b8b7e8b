"""MoE experts for training: transformers' grouped_mm experts without its scatter-heavy backward.

transformers (5.x) runs a MoE layer's experts through `experts_implementation` ("grouped_mm" by default: tokens
sorted by expert, one grouped GEMM per projection). Its gathers - the tokens by the sort (`hidden_states[perm // k]`),
each row's expert bias (`bias[expert_ids]`: tens of thousands of rows gathered from a handful) and the un-sort
(`out[inv_perm]`) - are advanced indexing, whose backward is an accumulating index_put: CUDA sorts the indices and
sums every run of equal ones serially. With 8 experts that is thousands of rows per run; on an H100 it took 46 % of a
gpt-oss-shaped step (benchmarks/profile_step.py --shape gpt-oss-2b: `indexing_backward_kernel`, 275 of 629 ms).

Here the same computation, registered as transformers' experts implementation "trainbox_grouped_mm":
- the gathers by a permutation are autograd Functions whose backward is the inverse gather (no accumulation: each
  row goes to one place): the tokens to their sorted slots by `Gather` (backward: un-sort and sum a token's k slots),
  the slots back to their tokens by `Combine`, Gather's adjoint (forward: un-sort and sum; backward: one gather);
- the up-projection biases are added as one_hot(expert) @ bias, whose backward is one small GEMM (E x S @ S x width);
  the down-projection biases per token, as routing (tokens x E, the routing weights) @ bias, after the k slots are
  summed;
- the grouped GEMMs are transformers' own (`_grouped_linear`);
- gpt-oss's gate (clamped, interleaved gate/up columns, `(up + 1) * gate * sigmoid(alpha * gate)`) is compiled on GPUs
  into one kernel forward and one backward that recomputes from the gate/up input: run op by op it is seven kernels
  forward and about fifteen backward over the (slots x 2 x intermediate) activations, ~118 bytes moved per output
  element against ~16 fused (estimated from the bytes: ~27 ms, 8 % of the gpt-oss-2b benchmark's step on an H100),
  and autograd keeps four intermediate-wide tensors for backward besides the input (6.3 GiB over the 12 layers of
  that shape, 16k tokens a step) where the compiled one keeps only its input. The same ops as transformers'
  `GptOssExperts._apply_gate`; other models keep their own gate, and so does the CPU (nothing to gain there).
  The compiled gate also multiplies each slot by its routing weight (the down GEMM is linear: scaling its input
  scales its output). That removes the multiply over the down GEMM's (slots x hidden) output, its backward and the
  output autograd kept for it: 3.8 ms of kernels and 1.5 GiB on the gpt-oss-2b benchmark step on an H100
  (benchmarks/results/moe_fold_tiles-2026-11-27.txt). Where the gate is not compiled the weights multiply the down
  GEMM's output, as transformers does (the cheaper side where the intermediate width is above hidden: Mixtral).
- for gpt-oss in bf16 on GPUs the whole of it (sort, gathers, GEMMs, biases, gate, combine) is one compiled graph,
  shared by every layer and batch (the token count symbolic): op by op its small kernels and their launches (about
  25 forward and 30 backward a layer) left the GPU waiting on the host. On the gpt-oss-2b benchmark step on an H200
  it took 8 ms of elementwise kernels off and ~5 ms off the step (benchmarks/results/moe_compiled-2026-11-28.txt).
  Float32 weights (under autocast) stay op by op with the gate compiled alone: transformers sends a compiled grouped
  GEMM of any dtype but bf16 to its fallback op, which has no backward. Inside a user's own torch.compile of the
  model (the Trainer's --torch_compile) nothing is compiled here: that compile traces the same ops.
Expert parallelism's sentinel ids (>= num_experts) are not handled: `applies` says where this is used.
"""

from __future__ import annotations

from trainbox.training.kernels import compilefail

NAME = "trainbox_grouped_mm"


def _functions():
    import torch

    class Gather(torch.autograd.Function):
        """x[index] where index (S,) maps S = rows * k slots onto x's rows, each row exactly k times; backward: the
        slots' gradients put back in slot order by `inverse` (the inverse of index's sort) and summed per row."""

        @staticmethod
        def forward(ctx, x, index, inverse, k: int):
            ctx.save_for_backward(inverse)
            ctx.k = k
            return x[index]

        @staticmethod
        def backward(ctx, grad):
            (inverse,) = ctx.saved_tensors
            return _sum_slots(grad, inverse, ctx.k), None, None, None

    class Combine(torch.autograd.Function):
        """Gather's adjoint: the S slots put back in slot order by `inverse` and each row's k summed; backward:
        grad[index] (each slot takes its row's gradient: a gather, no accumulation)."""

        @staticmethod
        def forward(ctx, x, index, inverse, k: int):
            ctx.save_for_backward(index)
            return _sum_slots(x, inverse, k)

        @staticmethod
        def backward(ctx, grad):
            (index,) = ctx.saved_tensors
            return grad[index], None, None, None

    class Permute(torch.autograd.Function):
        """x[perm] for a permutation; backward: grad[inverse]."""

        @staticmethod
        def forward(ctx, x, perm, inverse):
            ctx.save_for_backward(inverse)
            return x[perm]

        @staticmethod
        def backward(ctx, grad):
            (inverse,) = ctx.saved_tensors
            return grad[inverse], None, None

    return Gather, Combine, Permute


def _functions_once() -> None:
    if "gather" not in _FN:
        _FN["gather"], _FN["combine"], _FN["permute"] = _functions()


def _sum_slots(x, inverse, k: int):
    """x's S sorted slots back in slot order (token-major, k a token) and each token's k summed."""
    return x[inverse].view(-1, k, x.shape[-1]).sum(1)


_FN: dict = {}


def oss_gate(gate_up, alpha: float, limit: float, weights=None):
    """gpt-oss's gate, the ops of transformers' GptOssExperts._apply_gate (gate and up columns interleaved), each row
    times its routing weight when `weights` (rows,) is given."""
    import torch

    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    out = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return out if weights is None else out * weights.to(out.dtype).unsqueeze(-1)


def compiled():
    """oss_gate compiled as the experts call it: one graph for every batch, with only the slot count (rows) symbolic.
    alpha and limit are the config's floats, the same in every layer (Dynamo keeps them as constants). With every
    dim symbolic (`dynamic=True`) inductor could not see the width or the columns' stride: the gate's forward +
    backward took 18.4 ms a step for gpt-oss-2b's 12 layers on an H100, 9.1 ms with the width static
    (benchmarks/moe_gate.py)."""
    import torch

    fn = torch.compile(oss_gate, fullgraph=True)

    def gate(gate_up, alpha: float, limit: float, weights=None):
        torch._dynamo.maybe_mark_dynamic(gate_up, 0)
        if weights is not None:
            torch._dynamo.maybe_mark_dynamic(weights, 0)
        return fn(gate_up, alpha, limit, weights)

    return gate


def compiles(h) -> bool:
    """Whether the gate is compiled for `h`: on GPUs (tests force it on the CPU)."""
    return h.is_cuda


def _is_gpt_oss_gate(module) -> bool:
    """Whether `module`'s gate is transformers' GptOssExperts._apply_gate (looked up once: every layer asks)."""
    if "oss" not in _FN:
        try:
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
        except ImportError:  # pragma: no cover - a transformers without gpt-oss
            GptOssExperts = None
        _FN["oss"] = None if GptOssExperts is None else GptOssExperts._apply_gate
    return _FN["oss"] is not None and getattr(type(module), "_apply_gate", None) is _FN["oss"]


def _gate(module, h, weights):
    """(the module's gate, whether `weights` are multiplied in): gpt-oss's compiled gate with the routing weights folded
    in where it runs on a GPU (module docstring), else the model's own gate without them."""
    import torch

    if not compiles(h) or _FN.get("gate") is False or not _is_gpt_oss_gate(module):
        return module._apply_gate(h), False
    if torch.compiler.is_compiling():  # inside the user's own torch.compile (--torch_compile): it traces the ops
        return oss_gate(h, float(module.alpha), float(module.limit), weights), True
    if "gate" not in _FN:
        _FN["gate"] = compiled()
    try:
        return _FN["gate"](h, float(module.alpha), float(module.limit), weights), True
    except Exception as error:  # noqa: BLE001 - a compiler failure: the model's own ops compute the same
        if not compilefail.report(error, "MoE: gpt-oss's gate", "running it op by op"):
            raise  # the step's own (out of memory: the op-by-op gate needs more)
        _FN["gate"] = False
        return module._apply_gate(h), False


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface: hidden_states (tokens, hidden), top_k_index/top_k_weights (tokens, k)."""
    import torch

    device = hidden_states.device.type
    up, down = self.gate_up_proj if self.has_gate else self.up_proj, self.down_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    down_bias = self.down_proj_bias if self.has_bias else None
    autocast = torch.is_autocast_enabled(device)
    # gpt-oss in bf16 is compiled whole. Other dtypes stay op by op: transformers sends a compiled grouped GEMM of
    # any other dtype to its fallback op, which has no backward. With bf16 weights and input the Trainer's bf16
    # autocast would cast nothing here, so the compiled graph runs outside it (as flexattn's kernel does).
    bf16 = (hidden_states.dtype == up.dtype == down.dtype == torch.bfloat16
            and (not autocast or torch.get_autocast_dtype(device) == torch.bfloat16))
    if (bf16 and compiles(hidden_states) and not torch.compiler.is_compiling() and _FN.get("experts") is not False
            and self.has_gate and _is_gpt_oss_gate(self)):
        with torch.autocast(device_type=device, enabled=False):
            out = _compiled_experts(hidden_states, top_k_index, top_k_weights, up, down, up_bias, down_bias,
                                    self.num_experts, self.is_transposed, float(self.alpha), float(self.limit))
        if out is not None:
            return out
    given = hidden_states.dtype
    if autocast:
        # The grouped GEMMs are not autocast ops: transformers casts the input to the weights' dtype, so float32
        # weights under bf16 autocast (TRL's GRPO default) would run them in float32. Cast as autocast casts a Linear.
        dtype = torch.get_autocast_dtype(device)
        hidden_states, up, down = hidden_states.to(dtype), up.to(dtype), down.to(dtype)
    gate = (lambda h, w: _gate(self, h, w)) if self.has_gate else (lambda h, w: (self.act_fn(h), False))
    return _experts(hidden_states, top_k_index, top_k_weights, up, down, up_bias, down_bias, self.num_experts,
                    self.is_transposed, gate).to(given)


def _experts(hidden_states, top_k_index, top_k_weights, up, down, up_bias, down_bias, experts: int,
             transposed: bool, gate):
    """The experts' computation, op by op or traced whole by _compiled_experts. `gate(h, weights)` returns the
    activated intermediate and whether each slot's routing weight is multiplied in."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.moe import _grouped_linear

    _functions_once()
    tokens, k = top_k_index.shape
    ids, order = torch.sort(top_k_index.reshape(-1))  # slots grouped by expert
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    slot_rows = order // k
    x = _FN["gather"].apply(hidden_states, slot_rows, inverse, k)
    counts = torch.histc(ids.int() if ids.is_cuda else ids.float(), bins=experts, min=0, max=experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    weights = _FN["permute"].apply(top_k_weights.reshape(-1), order, inverse).to(x.dtype)  # (slots,), sorted

    h = _grouped_linear(x, up, offsets, is_transposed=transposed)
    if up_bias is not None:
        onehot = F.one_hot(ids, experts).to(x.dtype)
        h = h + onehot @ up_bias.to(h.dtype)
    h, weighted = gate(h, weights)
    out = _grouped_linear(h, down, offsets, is_transposed=transposed)
    if not weighted:
        out = out * weights.unsqueeze(-1)
    out = _FN["combine"].apply(out, slot_rows, inverse, k)  # (tokens, hidden)
    if down_bias is not None:  # sum over a token's slots of weight * bias[expert] = routing (tokens x E) @ bias
        routing = torch.zeros(tokens, experts, dtype=out.dtype, device=out.device)
        routing = routing.scatter(1, top_k_index, top_k_weights.to(out.dtype))
        out = torch.addmm(out, routing, down_bias.to(out.dtype))
    return out.to(hidden_states.dtype)


def _oss_experts(hidden_states, top_k_index, top_k_weights, up, down, up_bias, down_bias, experts: int,
                 transposed: bool, alpha: float, limit: float):
    """gpt-oss's experts with its gate inline (the routing weights folded in), for torch.compile to trace whole."""
    return _experts(hidden_states, top_k_index, top_k_weights, up, down, up_bias, down_bias, experts, transposed,
                    lambda h, w: (oss_gate(h, alpha, limit, w), True))


def _compiled_experts(hidden_states, top_k_index, top_k_weights, *rest):
    """_oss_experts compiled (one graph for every layer and batch: the token count symbolic), or None once it failed
    to compile (then the caller runs it op by op, with the gate compiled alone)."""
    import torch

    _functions_once()  # classes are made outside the trace (Dynamo cannot trace a class statement)
    if "experts" not in _FN:
        _FN["experts"] = torch.compile(_oss_experts, fullgraph=True)
    for t in (hidden_states, top_k_index, top_k_weights):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    try:
        return _FN["experts"](hidden_states, top_k_index, top_k_weights, *rest)
    except Exception as error:  # noqa: BLE001 - a compiler failure: the same computation runs op by op
        if not compilefail.report(error, "MoE: gpt-oss's experts",
                                  "running them op by op with the gate compiled alone"):
            raise
        _FN["experts"] = False
        return None


def balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func (Mixtral's, which TRL's fused LM head calls for every MoE family), the
    same sums, with each layer's top-k assignments counted by scatter_add instead of torch.bincount: bincount reads
    its largest index back to the host to size its output, a host<->device sync per layer (12 a step on the
    gpt-oss-2b benchmark shape, found by benchmarks/profile_step.py --syncs). Masked batches go to transformers'
    own, which counts with scatter_add already."""
    import torch

    if attention_mask is not None or not isinstance(gate_logits, tuple) or not gate_logits:
        return _FN["balancing"](gate_logits, num_experts, top_k, attention_mask)
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for layer in gate_logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        ones = torch.ones(chosen.numel(), dtype=torch.float32, device=device)
        counts = counts.scatter_add(0, chosen.reshape(-1), ones)
        probs = probs + weights.float().sum(dim=0)
        rows += weights.shape[0]
    return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * num_experts


def register() -> None:
    """Make experts_implementation="trainbox_grouped_mm" known to transformers, and Mixtral's balancing loss, which
    TRL's fused LM head imports at each call, sync-free (balancing_loss)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.mixtral import modeling_mixtral

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
    _functions_once()  # now, not inside a trace of the model (Dynamo cannot trace a class statement)
    if "balancing" not in _FN:
        _FN["balancing"] = modeling_mixtral.load_balancing_loss_func
        modeling_mixtral.load_balancing_loss_func = balancing_loss


def applies(model_class) -> str | None:
    """None when `model_class` (a transformers model class) dispatches its experts through transformers' experts
    interface, so NAME can be used; else why not."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: F401
    except ImportError:
        return "this transformers has no experts interface"
    can = getattr(model_class, "_can_set_experts_implementation", None)
    if can is None or not can():
        return f"{model_class.__name__} does not dispatch its experts through transformers' experts interface"
    return None


def choose(facts) -> tuple[dict, str | None]:
    """(from_pretrained's extra kwargs, the line to print) for a model with `facts` (modelfacts.ModelFacts): MoE models
    whose experts dispatch through transformers' interface get NAME; dense models nothing."""
    if not facts.experts:
        return {}, None
    if facts.experts_dispatch:
        return {}, f"MoE experts: transformers' own ({facts.experts_dispatch})"
    register()
    return {"experts_implementation": NAME}, (f"MoE experts: {NAME} (grouped GEMMs as transformers' grouped_mm; "
                                              "gathers whose backward needs no accumulating scatter)")
