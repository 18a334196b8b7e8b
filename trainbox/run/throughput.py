"""Steady-state throughput for the summary line: from the end of the first optimizer step to the end of the last,
so loading, data preparation, the first step's compilation/warm-up and the final save are not in it. A later step
during which torch.compile compiled graphs is left out too (Dynamo's graph count moved): under --torch_compile the
second shape's dynamic recompile took 21-29 s of a 10-step run on an H200, and the line read 2.1 % MFU for a run
that trains at 36 % (benchmarks/results/torch_compile-2026-11-28.txt).

Tokens are the Trainer's count of non-padding input tokens (summed over ranks), kept on the GPU between reads
(TokenCount). MFU = model FLOPs per second over
the GPUs' dense bf16 peak: per token 6 x the matmul parameters it goes through (forward + backward; an MoE token
only its top-k experts) plus causal attention, 6 x layers x (heads x head dim) x E[n^2]/E[n] for examples of n tokens
(a windowed layer counts at most W keys a token). GPU time comes from CUDA events recorded at step ends, so
measuring adds no host sync.
"""

from __future__ import annotations

import os
import time

from trainbox.run import ranks

# Dense bf16 peak per GPU in TFLOP/s (vendor data sheets, SXM parts unless named). TRAINBOX_PEAK_TFLOPS overrides.
PEAK_TFLOPS = (
    ("GH200", 989.4), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H800", 989.4),
    ("B300", 2250.0), ("B200", 2250.0), ("GB200", 2500.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
    ("A10", 125.0), ("L4", 121.0), ("RTX 4090", 165.2), ("RTX 6000 Ada", 364.2),
)


def peak_tflops(device_name: str) -> float | None:
    env = os.environ.get("TRAINBOX_PEAK_TFLOPS")
    if env:
        try:
            return float(env)
        except ValueError:
            return None
    for key, value in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def flops_per_token(facts, lengths) -> float:
    """6N + causal attention, averaged over examples of the given token lengths. N counts the parameters a token goes
    through (an MoE token: its top-k experts); a windowed layer's token attends to at most W keys."""
    lengths = [n for n in lengths if n > 0]
    if not lengths:
        return 6.0 * facts.active_matmul_params
    full_ctx = sum(n * n for n in lengths) / sum(lengths)
    w = facts.attention.window if facts.attention and facts.windowed_layers else 0
    win_ctx = sum(n * n if n <= w else 2 * n * w - w * w for n in lengths) / sum(lengths) if w else full_ctx
    ctx = (facts.layers - facts.windowed_layers) * full_ctx + facts.windowed_layers * win_ctx
    return 6.0 * facts.active_matmul_params + 6.0 * facts.attn_width * ctx


def example_lengths(dataset) -> list[int]:
    """Token lengths of the examples in a (possibly packed: `seq_lengths`) tokenized dataset; a preference pair
    (TRL's DPO columns) is two rows, prompt + chosen and prompt + rejected."""
    cols = getattr(dataset, "column_names", None) or []
    if {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(cols):
        return [len(p) + len(c) for key in ("chosen_ids", "rejected_ids")
                for p, c in zip(dataset["prompt_ids"], dataset[key])]
    if "seq_lengths" in cols:
        return [n for row in dataset["seq_lengths"] for n in row]
    if "input_ids" in cols:
        return [len(x) for x in dataset["input_ids"]]
    return []


def _callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class TokenCount:
    """The Trainer's non-padding token count (state.num_input_tokens_seen) kept on the GPU between reads: HF's
    `_track_num_input_tokens` calls .item() every micro-batch, a host<->device sync at the start of each step that
    drains the GPU's queue (the previous optimizer step) before the next forward can be launched; on the gpt-oss-2b
    benchmark shape that sync, with the data loader's blocking copies, left the GPU idle ~28 ms of a 288 ms step
    (benchmarks/profile_step.py --syncs --gaps). Here the same count is summed on the device and added to the state
    where something reads it: before a log line, before a checkpoint is written (resume reads it), at the end.
    The count is HF's: the attention mask's sum, else the tokens that are not padding, else all of them."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.pending = None  # device int64: tokens counted since the last settle
        self._track, self._log, self._save = trainer._track_num_input_tokens, trainer.log, trainer._save_checkpoint

    @classmethod
    def install(cls, trainer, on_gpu: bool) -> TokenCount | None:
        """Replaces `trainer`'s per-step count on a GPU when it counts non-padding tokens; None where HF's stays
        (on the CPU there is no queue to drain)."""
        if trainer.args.include_num_input_tokens_seen != "non_padding" or not on_gpu:
            return None
        count = cls(trainer)
        trainer._track_num_input_tokens = count.track
        trainer.log = count.log
        trainer._save_checkpoint = count.save_checkpoint
        return count

    def track(self, inputs) -> None:
        import torch

        tr = self.trainer
        name = getattr(tr.model, "main_input_name", "input_ids")
        if name not in inputs:
            return self._track(inputs)  # HF's warning
        pad = getattr(tr.processing_class, "pad_token_id", None)
        if "attention_mask" in inputs:
            n = inputs["attention_mask"].sum()
        elif pad is not None:
            n = (inputs[name] != pad).sum()
        else:
            return self._track(inputs)  # HF's warning, then all tokens
        n = tr.accelerator.gather(torch.as_tensor(n, device=tr.args.device, dtype=torch.int64)).sum()
        self.pending = n if self.pending is None else self.pending + n

    def settle(self) -> None:
        if self.pending is not None:
            self.trainer.state.num_input_tokens_seen += int(self.pending.item())
            self.pending = None

    def snapshot(self, state) -> tuple:
        """(the state's count, the device's pending count or None): no sync; `total` adds them up later."""
        return int(getattr(state, "num_input_tokens_seen", 0) or 0), (None if self.pending is None
                                                                       else self.pending.clone())

    @staticmethod
    def total(snap: tuple) -> int:
        host, pending = snap
        return host + (int(pending.item()) if pending is not None else 0)

    def log(self, *args, **kwargs):
        self.settle()
        return self._log(*args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        self.settle()
        return self._save(*args, **kwargs)


def graphs_compiled() -> int:
    """How many graphs torch.compile (Dynamo) has compiled in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without Dynamo
        return 0
    return int(counters["stats"]["unique_graphs"])


def _span(a: tuple, b: tuple) -> tuple[int, int, float]:
    """(steps, real tokens, seconds) from mark `a` to mark `b` (GPU time where both carry a CUDA event)."""
    seconds = b[2] - a[2]
    if a[3] is not None and b[3] is not None:
        seconds = a[3].elapsed_time(b[3]) / 1000.0
    return b[0] - a[0], TokenCount.total(b[1]) - TokenCount.total(a[1]), seconds


class Throughput(_callback_base()):
    def __init__(self, flops_per_token: float | None = None):
        super().__init__()
        self.flops_per_token = flops_per_token
        self.first: tuple | None = None  # (step, tokens: TokenCount.snapshot's pair, wall time, cuda event)
        self.last: tuple | None = None
        self.graphs: int | None = None  # Dynamo's compiled-graph count at the last step end
        self.compiled: list = []  # (mark before, mark after) of the steady steps that compiled: left out
        self.count: TokenCount | None = None  # set by sftlib where the count stays on the GPU

    def _mark(self, state):
        ev = None
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
        except ImportError:  # pragma: no cover
            pass
        tokens = (self.count.snapshot(state) if self.count is not None
                  else (int(getattr(state, "num_input_tokens_seen", 0) or 0), None))
        return int(state.global_step), tokens, time.perf_counter(), ev

    def on_step_end(self, args, state, control, **kwargs):
        mark = self._mark(state)
        graphs = graphs_compiled()
        if self.first is None:
            self.first = mark
        else:
            if graphs != self.graphs:
                self.compiled.append((self.last or self.first, mark))
            self.last = mark
        self.graphs = graphs
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.count is not None:
            self.count.settle()  # the run summary and the saved state read the count
        return control

    def figures(self) -> dict | None:
        """steps/s, tokens/s, TFLOP/s per GPU and MFU over the steady steps, or None before two steps ended."""
        if self.first is None or self.last is None:
            return None
        if self.last[3] is not None:
            self.last[3].synchronize()  # every earlier event has completed too
        steps, tokens, seconds = _span(self.first, self.last)
        left_out = [_span(a, b) for a, b in self.compiled]
        if steps - sum(n for n, _, _ in left_out) > 0:  # else every steady step compiled: they stay in
            steps -= sum(n for n, _, _ in left_out)
            tokens -= sum(t for _, t, _ in left_out)
            seconds -= sum(w for _, _, w in left_out)
        else:
            left_out = []
        seconds = max(seconds, 1e-9)
        out = {"steps": steps, "seconds": seconds, "steps_per_s": steps / seconds, "tokens_per_s": tokens / seconds,
               "compile_steps": len(left_out)}
        if self.flops_per_token and tokens > 0:
            tflops = self.flops_per_token * out["tokens_per_s"] / ranks.world_size() / 1e12
            out["tflops_per_gpu"] = tflops
            try:
                import torch

                if torch.cuda.is_available():
                    peak = peak_tflops(torch.cuda.get_device_name())
                    if peak:
                        out["mfu"] = tflops / peak
            except ImportError:  # pragma: no cover
                pass
        return out

    def summary(self) -> str | None:
        f = self.figures()
        if f is None:
            return None
        left = f" ({f['compile_steps']} that compiled left out)" if f["compile_steps"] else ""
        s = (f"steady {f['steps']} steps{left} in {f['seconds']:.1f}s: {f['steps_per_s']:.3f} steps/s, "
             f"{f['tokens_per_s']:,.0f} real tokens/s")
        if "tflops_per_gpu" in f:
            s += f", {f['tflops_per_gpu']:.0f} TFLOP/s per GPU"
        if "mfu" in f:
            s += f", MFU {100 * f['mfu']:.1f} %"
        return s
