"""Train on borrowed cores: a model's forward and backward switch their torch thread count
between decoder layers, using the cores of idle rollout replica processes beside the trainer.

:class:`ThreadLender` wraps a :class:`~postrl.protocol.cores.CoreBorrower`. Inside a
:meth:`ThreadLender.section` (one worker call: an update, a log-prob pass) every decoder layer's
forward, and its backward (a hook on the layer's output gradient), first polls the lease: the
thread count becomes the worker's own plus the threads of every replica that has no request in
flight, and drops back as soon as a replica claims its cores (it then waits at most one layer).
At the section's end everything borrowed is given back. The polls sit at each
layer's sub-blocks too (attention, MLP, norms: the layer's children) and at the output
embeddings (the LM head and the loss after the last layer were 30–40 ms without a poll on a
1-thread W1 update, so a replica that went idle there lent its cores only from the first
backward layer on). Polling costs one ``flock`` per owner and a ``torch.set_num_threads`` only
when the count changes (0.2 µs); a 4-layer W1 update polls ≈ 40 times.

Only the thread that opened the section switches (the OpenMP thread count is per calling
thread): a forward that runs in another thread inside the section is not touched.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["ThreadLender", "decoder_layers"]


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the longest ``nn.ModuleList`` in it (a HF decoder's
    ``model.layers``, also under LoRA or FSDP wrappers); [] when it has none."""
    best: list[nn.Module] = []
    for m in module.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best):
            best = list(m)
    return best


class ThreadLender:
    """Borrow idle cores for one model's compute (module docstring).

    Args:
        borrower: the lease (:class:`~postrl.protocol.cores.CoreBorrower`).
        base_threads: the worker's own torch threads (``trainer.num_threads``; 0: torch's
            current count).
    """

    def __init__(self, borrower: Any, base_threads: int = 0) -> None:
        self.borrower = borrower
        self.base = int(base_threads) or torch.get_num_threads()
        self.polls = 0
        """Polls so far (one per layer forward and backward inside a section)."""
        self._thread: int | None = None  # the section's thread; None: outside a section
        self._threads = self.base
        self._handles: list[Any] = []

    def install(self, module: nn.Module) -> int:
        """Hook every decoder layer of ``module`` (:func:`decoder_layers`), its sub-blocks and the
        output embeddings; returns how many layers."""
        layers = decoder_layers(module)
        points = [m for layer in layers for m in (layer, *layer.children())]
        head = getattr(module, "get_output_embeddings", lambda: None)()
        if isinstance(head, nn.Module):
            points.append(head)
        for m in points:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        return len(layers)

    def _pre(self, module: nn.Module, args: Any) -> None:
        self.poll()

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        t = out[0] if isinstance(out, (tuple, list)) else out
        if self._thread is not None and isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(self._grad_hook)

    def _grad_hook(self, grad: torch.Tensor) -> None:
        self.poll()

    def poll(self) -> None:
        """Inside a section, on its thread: take idle cores, give back claimed ones."""
        if self._thread != threading.get_ident():
            return
        self.polls += 1
        n = self.base + self.borrower.poll()
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    @contextmanager
    def section(self) -> Iterator[None]:
        """One worker call's compute: polls at its start and between layers, gives everything
        back and restores the worker's own thread count at its end."""
        if self._thread is not None:  # nested (e.g. a log-prob pass inside an update)
            yield
            return
        self._thread = threading.get_ident()
        try:
            self.poll()
            yield
        finally:
            self._thread = None
            self.borrower.release()
            if self._threads != self.base:
                torch.set_num_threads(self.base)
                self._threads = self.base

    def close(self) -> None:
        """Remove the hooks and close the lease."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.borrower.close()
