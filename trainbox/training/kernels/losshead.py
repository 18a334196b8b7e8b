"""SFT's loss head in one pass: the LM head's GEMM, the next-token log-probabilities and their gradients together.

TRL's fused LM head (trl.trainer.utils.add_fused_lm_head over trl.kernels.ChunkedLogProbFunction) never holds the
full logits: its forward folds (4,096 tokens x 32,768 vocabulary) tiles into each token's log-sum-exp, and its
backward computes every tile again, turns it into the logits' gradient and runs the two gradient GEMMs: four
(tokens x vocabulary x hidden) GEMMs. SFT's loss weighs every token's log-probability alike (their sum over the
number of tokens), so the gradient of a token's logits is known in the forward pass up to that one factor. Here a
tile spans the whole vocabulary (up to 4,096 tokens, at most TILE_BYTES), so TRL's own kernels finish it at once: its
forward fold gives each token's log-sum-exp, its backward kernel (with a unit weight) overwrites the tile with the
logits' gradient, and the two gradient GEMMs run right away: three GEMMs, nothing computed twice. The backward
scales the gradients by the factor it receives (the hidden states' rows by each token's own factor, which is exact
for any weighting; the LM head's gradient by the common one).

When: `install(trainer)` puts `LogProbs` where TRL's add_fused_lm_head looks its function up and runs the trainer's
compute_loss inside `uniform()`, for TRL's plain NLL loss (no compute_loss_func, label smoothing or DFT) on a GPU,
unless TRAINBOX_ONE_PASS_LOSS=0 or its self-check (our head against TRL's on a tiny CPU case: the per-tile kernels
are TRL's private functions) fails. There the path is taken for bf16/fp16 weights and hidden states, no bias, grad
enabled. Everything else runs TRL's own function, unchanged: GRPO's weighted losses, evaluation, float32 weights
under autocast, FSDP2 (its gathered head is float32). Should a caller inside `uniform()` still weigh the tokens
unevenly, the backward sees it and computes the LM head's gradient again from the tiles (slower, exact).
Scored rows: TRL's fused forward keeps the labelled rows with `hidden[mask]` and puts the results back with
`masked_scatter`, whose backward ops (masked_select, a boolean index_put_) read the mask's count on the host: the
backward's first op waited there for the head's ~35 ms of GEMMs, and the rest of a MoE backward was then launched at
the host's pace. Where the caller passes the rows (`uniform(known=True, rows=...)`, sftloss.py) TRL's forward is
told not to compact and the head picks the rows itself (index_select / index_copy: one read of the count in the
forward, where the GPU is barely behind, none in the backward).
Memory: one tile (<= TILE_BYTES), the hidden states' gradient and the float32 LM head gradient, from the loss head's
forward to its backward; TRL holds the same gradients and a smaller tile in its backward (memplan counts the tile).
Measured on one H100 (benchmarks/results/loss_head-2026-11-27.txt): the head 58.3 -> 46.1 ms at 16k tokens x 128k
vocabulary, +0.17 GiB at its peak; `trainbox sft` on the Llama 1B shape 56.3k -> 58.9-59.3k real tok/s at the same
losses.
"""

from __future__ import annotations

import contextlib
import os

from trainbox.training.kernels import switches

ENV = "TRAINBOX_ONE_PASS_LOSS"  # 0: TRL's own head everywhere
TILE_BYTES = 2**30  # one (tokens x vocabulary) tile of logits, overwritten by their gradient
TILE_TOKENS = 4096  # at most: fewer tiles means fewer passes over the float32 LM head gradient they add into
OUTPUTS = ("log_probs", "entropy", "is_top1")  # what TRL's SFTTrainer asks its fused head for (this path gives these)

_uniform: bool | str = False  # inside uniform(): the caller's loss weighs every token alike ("known": by construction)
_rows = None  # inside uniform(rows=...): which of TRL's rows carry a label (a bool tensor: TRL's `mask`)
_in_compiled = False  # the head was called from the user's compiled graph (--torch_compile), behind a graph break
_FN: dict = {}  # "trl": TRL's function, "eager": ours behind a graph break (install); "fn": OnePassLogProbs; "check"


@contextlib.contextmanager
def uniform(known: bool = False, rows=None):
    """Marks a loss that is a uniformly weighted sum of the fused head's log-probabilities (SFT's NLL). `known`: the
    caller wrote that loss itself (sftloss.py), so the backward skips its check of the weights, a host sync that
    waited for the head's GEMMs before the rest of the backward could be launched. `rows`: TRL's label mask for the
    call (`labels[:, 1:] != -100`), so the rows are picked here without host syncs in the backward (module doc)."""
    global _uniform, _rows
    before = _uniform, _rows
    _uniform = "known" if known or before[0] == "known" else True
    _rows = rows
    try:
        yield
    finally:
        _uniform, _rows = before


def install(trainer, on_gpu: bool) -> str | None:
    """Our head for `trainer` (TRL's SFTTrainer, its model already patched by add_fused_lm_head) when it trains on a
    GPU with the plain NLL loss: returns the line to print, or None where TRL's own head stays."""
    import trl.trainer.utils as trl_utils

    args = trainer.args
    if (not on_gpu or getattr(trainer, "compute_loss_func", None) is not None
            or getattr(trainer, "label_smoother", None) is not None
            or getattr(args, "loss_type", "nll") != "nll" or not hasattr(trl_utils, "_ChunkedLogProbFunction")):
        return None
    on = switches.switch(os.environ.get(ENV), default=True)
    if on is False:
        return f"loss head: TRL's ({ENV}={os.environ.get(ENV)})"
    if "check" not in _FN:
        _FN["check"] = self_check()
    if _FN["check"]:
        return f"loss head: TRL's ({_FN['check']})"
    import torch

    _FN["eager"] = torch.compiler.disable(_from_compiled)
    current = trl_utils._ChunkedLogProbFunction
    if current is not LogProbs:
        _FN["trl"] = current
        trl_utils._ChunkedLogProbFunction = LogProbs
    if hasattr(trl_utils, "_use_triton") and trl_utils._use_triton is not _compact:
        # TRL's fused forward asks it whether to compact the rows (`hidden[mask]`): not where the rows are given
        _FN["compact"] = trl_utils._use_triton
        trl_utils._use_triton = _compact
    compute_loss = trainer.compute_loss

    def compute_loss_uniform(*a, **kw):
        with uniform():
            return compute_loss(*a, **kw)

    trainer.compute_loss = compute_loss_uniform
    note = "" if on else f"; {ENV}={os.environ.get(ENV)!r} is neither 0 nor 1: left on"
    return ("loss head: one pass (the logits' gradient made in the forward: 3 GEMMs over the vocabulary instead of "
            f"TRL's 4; {ENV}=0 keeps TRL's)" + note)


def applies(hidden, weight, bias, outputs) -> bool:
    """Whether this call of the fused head takes our path (module docstring)."""
    import torch

    if not (_uniform and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return False
    if bias is not None or not hidden.is_cuda or hidden.dim() != 2 or not set(outputs) <= set(OUTPUTS):
        return False
    if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
        return False
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") != hidden.dtype:
        return False
    return type(weight) in (torch.Tensor, torch.nn.Parameter)


def _compact(device) -> bool:
    """Stands where TRL's fused forward finds `_use_triton` (its choice to score only the labelled rows): False
    while uniform(rows=...) gives the rows, which LogProbs then picks itself; TRL's answer otherwise."""
    return False if _rows is not None else _FN["compact"](device)


def _from_compiled(*args):
    """LogProbs._rows_given, marked as called from the user's compiled graph (install wraps it in a graph break)."""
    global _in_compiled
    _in_compiled = True
    try:
        return LogProbs._rows_given(*args)
    finally:
        _in_compiled = False


class LogProbs:
    """Stands where TRL's add_fused_lm_head finds ChunkedLogProbFunction, with its `apply` signature: ours where
    `applies`, TRL's own otherwise; with the rows given (uniform(rows=...)), on those rows only."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=OUTPUTS):
        import torch

        if torch.compiler.is_compiling():
            # inside the user's own torch.compile (--torch_compile): the head runs eagerly at a graph break (install
            # made the wrapper, outside any trace); Dynamo can't trace its float32-output GEMMs (`out_dtype` with
            # `out=`) and crashed there
            return _FN["eager"](hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                logit_scale, outputs)
        return LogProbs._rows_given(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                    logit_scale, outputs)

    @staticmethod
    def _rows_given(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                    outputs):
        rows = _rows
        if rows is None:
            return LogProbs._scored(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                    logit_scale, outputs)
        if hidden.dim() != 2 or rows.numel() != hidden.shape[0]:
            # not the rows this TRL scored: its own function, right for any weighting of them
            return _FN["trl"].apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                    logit_scale, outputs)
        # TRL scored every row (its targets there: labels.clamp(min=0)) and zeroes the unlabelled ones after us
        pick = rows.reshape(-1).nonzero().squeeze(1)  # the count is read here, in the forward
        got = LogProbs._scored(hidden.index_select(0, pick), weight, bias, targets.index_select(0, pick),
                               temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)
        return tuple(None if x is None else x.new_zeros(rows.numel()).index_copy(0, pick, x) for x in got)

    @staticmethod
    def _scored(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                outputs):
        if applies(hidden, weight, bias, outputs):
            return one_pass().apply(hidden, weight, targets, float(temperature), final_logit_softcapping,
                                    float(logit_scale), tuple(outputs))
        return _FN["trl"].apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                logit_scale, outputs)


def _kernels(device):
    """TRL's own per-tile steps (trl.kernels.chunked_logprob): on GPUs its Triton kernels, elsewhere their torch
    twins; (forward fold for n rows, backward for n rows x cols, their BLOCK_SIZE). Our tiles are just wider."""
    from trl.kernels import chunked_logprob as k

    if k._use_triton(device):
        import triton

        return (lambda n: k._forward_kernel[(n,)],
                lambda n, cols: k._backward_kernel[(n, triton.cdiv(cols, k._BLOCK_SIZE))], k._BLOCK_SIZE)
    return (lambda n: k._forward_tile), (lambda n, cols: k._backward_tile), k._BLOCK_SIZE


def self_check() -> str | None:
    """None when our head gives TRL's own results on a tiny CPU case (this TRL's private per-tile steps, called as
    _kernels calls them, whose GPU kernels share their torch twins' signature), else why not: a TRL that renamed or
    changed them keeps its own head instead of failing mid-run."""
    try:
        import torch
        from trl.kernels import ChunkedLogProbFunction

        g = torch.Generator().manual_seed(0)
        h = torch.randn(6, 8, generator=g).requires_grad_(True)
        w = torch.randn(40, 8, generator=g).requires_grad_(True)
        t = torch.randint(0, 40, (6,), generator=g)
        got = []
        for fn in (lambda: one_pass().apply(h, w, t, 1.0, 5.0, 1.0, OUTPUTS),
                   lambda: ChunkedLogProbFunction.apply(h, w, None, t, 1.0, 16, 5.0, 1.0, OUTPUTS)):
            h.grad = w.grad = None
            lp = fn()[0]
            (-lp.sum() / len(t)).backward()
            got.append((lp.detach(), h.grad, w.grad))
    except Exception as error:  # noqa: BLE001 - any failure means: not this TRL
        from common import errors

        return f"this TRL's kernels did not take the one-pass call ({errors.brief(error)})"
    if all(torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(*got)):
        return None
    return "the one-pass head differs from this TRL's on a test case"


def _fp32_product(a, b, out, add: bool) -> None:
    """out (float32) = a @ b, or += with `add`, without rounding the product to a's dtype first."""
    import torch

    if out.is_cuda and a.dtype != torch.float32:
        if add:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif add:
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


def tile_tokens(vocab: int, itemsize: int) -> int:
    """Rows of a tile: TILE_TOKENS, fewer (a multiple of 128) where a row of the vocabulary makes it pass TILE_BYTES."""
    return max(128, min(TILE_TOKENS, TILE_BYTES // max(1, vocab * itemsize) // 128 * 128))


def _tiles(hidden, weight):
    """(tile, hidden rows, their slice) for each block of rows: the tile (rows x vocabulary, in one reused buffer)
    holds their raw logits hidden @ weight.T."""
    import torch

    n, vocab = hidden.shape[0], weight.shape[0]
    rows = tile_tokens(vocab, hidden.element_size())
    buf = torch.empty((min(n, rows), vocab), device=hidden.device, dtype=hidden.dtype)
    for start in range(0, n, rows):
        end = min(start + rows, n)
        tile, h = buf[: end - start], hidden[start:end]
        torch.mm(h, weight.t(), out=tile)
        yield tile, h, slice(start, end)


def one_pass():
    """The autograd Function (built on first use: torch is imported late); one_pass().apply(hidden, weight, targets,
    temperature, softcap, logit_scale, outputs)."""
    if "fn" not in _FN:
        _FN["fn"] = _function()
    return _FN["fn"]


def _function():
    import torch

    class OnePassLogProbs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets, temperature, softcap, logit_scale, outputs):
            ctx.set_materialize_grads(False)
            n, vocab = hidden.shape[0], weight.shape[0]
            dev = hidden.device
            consts = dict(logit_scale=logit_scale, softcap=softcap or 1.0, inv_t=1.0 / temperature,
                          HAS_SOFTCAP=softcap is not None)
            need_h, need_w = ctx.needs_input_grad[:2]
            f32 = dict(device=dev, dtype=torch.float32)
            running_max = torch.full((n,), float("-inf"), **f32)
            before_target = torch.full((n,), float("-inf"), **f32)
            # sq_sum_exp and z_sum: statistics SFT doesn't ask for, read (not written) by TRL's kernel all the same
            sum_exp, x_sum_exp, target_logit, sq_sum_exp, z_sum = (torch.zeros(n, **f32) for _ in range(5))
            unit = torch.ones(n, **f32)  # d log p / d log p: the tiles' gradients before the caller's factor
            # float32: the backward scales it by each token's factor, then rounds once (as TRL's float32 sums)
            grad_hidden = torch.empty(hidden.shape, **f32) if need_h else None
            grad_weight = torch.zeros(weight.shape, **f32) if need_w else None
            log_z = torch.empty(n, **f32)
            fold, grad_of, block = _kernels(dev)
            for tile, h, part in _tiles(hidden, weight):
                rows, t = len(h), targets[part]
                fold(rows)(tile, tile.stride(0), t, running_max[part], sum_exp[part], x_sum_exp[part],
                           sq_sum_exp[part], z_sum[part], before_target[part], target_logit[part], 0, vocab,
                           BLOCK_SIZE=block, HAS_ENTROPY=True, HAS_LOG_SUM_SQ_PROBS=False, HAS_MEAN_LOGITS=False,
                           HAS_IS_TOP1=True, **consts)
                torch.add(running_max[part], torch.log(sum_exp[part]), out=log_z[part])
                lz = log_z[part]  # (also in the entropy slots: no entropy gradient)
                grad_of(rows, vocab)(tile, tile.stride(0), t, lz, lz, unit[part], lz, 0, vocab,
                                     HAS_LOGPROB_GRAD=True, HAS_ENTROPY_GRAD=False, BLOCK_SIZE=block, **consts)
                if grad_hidden is not None:
                    _fp32_product(tile, weight, grad_hidden[part], add=False)
                if grad_weight is not None:
                    _fp32_product(tile.t(), h, grad_weight, add=True)
            log_probs = target_logit - log_z
            entropy = log_z - x_sum_exp / sum_exp
            top1 = (target_logit >= running_max) & (target_logit > before_target)
            ctx.save_for_backward(hidden, weight, targets, log_z, grad_hidden, grad_weight)
            ctx.consts, ctx.known, ctx.in_compiled = consts, _uniform == "known", _in_compiled
            ctx.mark_non_differentiable(top1)
            return (log_probs, entropy if "entropy" in outputs else None, None, None,
                    top1 if "is_top1" in outputs else None)

        @staticmethod
        def backward(ctx, grad_log_probs, grad_entropy, *_):
            # A compiled graph around the head (the user's --torch_compile) hands zeros for the outputs it doesn't
            # use: taken as none where our sftloss wrote the loss (it reads only the log-probabilities); elsewhere
            # they are checked (a host sync, on that path only)
            if grad_entropy is not None and not (ctx.in_compiled and (ctx.known or not grad_entropy.any())):
                raise RuntimeError("trainbox's one-pass loss head has no entropy gradient: the loss reads only the "
                                   "log-probabilities (losshead.uniform() around a loss that needs it?)")
            hidden, weight, targets, log_z, grad_hidden, grad_weight = ctx.saved_tensors
            if grad_log_probs is None:
                return None, None, None, None, None, None, None
            g = grad_log_probs.float().contiguous()
            # Products written straight into tensors of the parameters' dtype (computed in float32, rounded once):
            # no float32 temporary as large as the LM head beside its float32 gradient
            dh = None if grad_hidden is None else torch.mul(grad_hidden, g.unsqueeze(-1), out=torch.empty_like(hidden))
            dw = None
            if grad_weight is not None:
                if ctx.known or g.numel() == 0 or bool((g == g[0]).all()):  # SFT's loss: one factor for every token
                    dw = torch.mul(grad_weight, g[0] if g.numel() else 0.0, out=torch.empty_like(weight))
                else:
                    dw = _weighted_weight_grad(hidden, weight, targets, log_z, g, ctx.consts).to(weight.dtype)
            return dh, dw, None, None, None, None, None

    return OnePassLogProbs


def _weighted_weight_grad(hidden, weight, targets, log_z, g, consts):
    """The LM head's gradient for tokens weighted unevenly (not SFT's loss): each tile computed again, as TRL does."""
    import torch

    out = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
    _, grad_of, block = _kernels(hidden.device)
    for tile, h, part in _tiles(hidden, weight):
        lz = log_z[part]
        grad_of(len(h), weight.shape[0])(tile, tile.stride(0), targets[part], lz, lz, g[part], lz, 0, weight.shape[0],
                                         HAS_LOGPROB_GRAD=True, HAS_ENTROPY_GRAD=False, BLOCK_SIZE=block, **consts)
        _fp32_product(tile.t(), h, out, add=True)
    return out
