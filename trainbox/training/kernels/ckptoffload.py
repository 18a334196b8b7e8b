"""Gradient checkpointing's kept inputs in pinned host memory, copied out and back beside the compute (qlora).

Checkpointing keeps one tensor per decoder layer for backward, the layer's input (tokens x hidden), and recomputes the
rest. On a 4-bit 8B base that is most of what is left after the weights: 32 layers x 4,096 tokens x 4,096 x 2 bytes
= 1 GiB of an ~7.6 GiB run, and on a 12 GB card it is the difference. Unsloth's "unsloth" checkpointing moves the same
tensors to the host; this does it with torch's saved-tensor hooks around the model's own checkpoint function (so
transformers, PEFT and the Trainer run as they are): each kept input of a MiB or more is copied to pinned host memory
on a side stream as soon as forward has made it (the compute stream never waits for it; the allocator keeps the GPU
block until the copy is done), and in backward the layer below's input is brought back on that stream while this
layer recomputes, so the compute stream waits only for a copy that is late.

Only under gradient checkpointing on a GPU, one process per model copy (FSDP2 frees the same memory its own way);
where the memory plan leaves checkpointing off there is nothing kept to move. TRAINBOX_CKPT_OFFLOAD=0 keeps them on
the GPU.
"""

from __future__ import annotations

import functools
import os
import weakref

from trainbox.training.kernels import switches

ENV = "TRAINBOX_CKPT_OFFLOAD"
MIN_BYTES = 1 << 20  # smaller kept tensors (rotary tables, masks) stay where they are


class _Item:
    """One kept tensor in host memory: its copy-out event, and once fetched its GPU copy and copy-back event."""

    __slots__ = ("host", "device", "out", "back", "gpu", "pos", "__weakref__")

    def __init__(self, host, device, out, pos):
        self.host, self.device, self.out, self.pos = host, device, out, pos
        self.back = self.gpu = None


class Offloader:
    """The saved-tensor hooks: pack copies a big CUDA tensor to the host, unpack brings it back (prefetched)."""

    def __init__(self):
        import torch

        self.torch = torch
        self._stream = None  # made at the first CUDA tensor (a CPU-only process never needs one)
        # This forward's packed tensors in order, held weakly: autograd owns them, so a graph freed without a
        # backward (an exception, a skipped step) leaves no host memory behind here.
        self.items: list[weakref.ref] = []
        self.moved = 0  # bytes copied out in the last forward

    @property
    def stream(self):
        if self._stream is None:
            self._stream = self.torch.cuda.Stream()
        return self._stream

    def _live(self, pos: int):
        item = self.items[pos]() if 0 <= pos < len(self.items) else None
        return item if item is not None and item.gpu is None else None

    def pack(self, t):
        torch = self.torch
        if not t.is_cuda or t.numel() * t.element_size() < MIN_BYTES:
            return t
        if not any(self._live(i) for i in range(len(self.items))):  # a new forward: nothing left to bring back
            self.items, self.moved = [], 0
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        t.record_stream(self.stream)  # its GPU block is not reused before the copy has read it
        item = _Item(host, t.device, done, len(self.items))
        self.items.append(weakref.ref(item))
        self.moved += host.numel() * host.element_size()
        return item

    def _fetch(self, item: _Item) -> None:
        torch = self.torch
        if item.gpu is not None:
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(item.out)
            item.gpu = item.host.to(item.device, non_blocking=True)
            item.back = torch.cuda.Event()
            item.back.record()

    def unpack(self, item):
        if not isinstance(item, _Item):
            return item
        torch = self.torch
        self._fetch(item)
        for prev in range(item.pos - 1, -1, -1):  # the input the next layer's backward needs: start its copy now
            nxt = self._live(prev)
            if nxt is not None:
                self._fetch(nxt)
                break
        torch.cuda.current_stream().wait_event(item.back)
        item.gpu.record_stream(torch.cuda.current_stream())
        return item.gpu

    def wrap(self, checkpoint_fn):
        if getattr(checkpoint_fn, "_trainbox_offload", False):
            return checkpoint_fn

        @functools.wraps(checkpoint_fn)
        def run(*args, **kwargs):
            with self.torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return checkpoint_fn(*args, **kwargs)

        run._trainbox_offload = True
        return run


def setting() -> tuple[bool, str | None]:
    """(on?, a note on the variable): switches.setting for ENV."""
    return switches.setting(ENV)


def _wrap_layers(model, off: Offloader) -> int:
    n = 0
    for module in model.modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if fn is not None and getattr(module, "gradient_checkpointing", False):
            module._gradient_checkpointing_func = off.wrap(fn)
            n += 1
    return n


def install(model) -> int | None:
    """Offload the kept inputs of every checkpointed layer of `model` (a transformers model, PEFT-wrapped or not),
    now and whenever the Trainer (re-)enables checkpointing; returns the layers wrapped now (None: not a model
    with transformers' checkpointing, nothing done)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's wrapper: its model
    if not callable(getattr(base, "gradient_checkpointing_enable", None)):
        return None
    off = Offloader()
    enable = base.gradient_checkpointing_enable

    @functools.wraps(enable)
    def gradient_checkpointing_enable(*args, **kwargs):
        out = enable(*args, **kwargs)
        _wrap_layers(base, off)
        return out

    base.gradient_checkpointing_enable = gradient_checkpointing_enable
    base._trainbox_offloader = off
    return _wrap_layers(base, off)


def choose(model, checkpointing: bool, on_gpu: bool, distributed: bool) -> str | None:
    """Install where it applies; the line to print, or None."""
    if not (checkpointing and on_gpu) or distributed:
        return None
    on, note = setting()
    if not on:
        return f"checkpointed layer inputs kept on the GPU ({ENV}={os.environ.get(ENV)})"
    if install(model) is None:
        return note
    return (f"checkpointed layer inputs offloaded to pinned host memory, copied beside the compute ({ENV}=0 keeps "
            "them on the GPU)" + (f"; {note}" if note else ""))
