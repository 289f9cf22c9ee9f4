"""Training on borrowed cores: the thread count switches between decoder layers."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from torch import nn

from postrl.engine.lending import ThreadLender, decoder_layers
from postrl.protocol.cores import CoreBorrower, CoreOwner


class _Layer(nn.Module):
    """Records the thread count its forward and its backward ran with."""

    def __init__(self, log: list[tuple[str, int, int]], i: int, on_forward=None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.log, self.i, self.on_forward = log, i, on_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_forward is not None:
            self.on_forward(self.i)
        self.log.append(("fwd", self.i, torch.get_num_threads()))
        if x.requires_grad:  # fires after this layer's backward: the count it ran with
            x.register_hook(lambda g: self.log.append(("bwd", self.i, torch.get_num_threads())))
        return x * self.w


class _Model(nn.Module):
    def __init__(self, log, on_forward=None) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(_Layer(log, i, on_forward) for i in range(3))
        self.extra = nn.ModuleList([nn.Linear(4, 4)])  # a shorter list: not the blocks

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_decoder_layers_are_the_longest_module_list():
    model = _Model([])
    assert decoder_layers(model) == list(model.layers)
    assert decoder_layers(nn.Linear(2, 2)) == []


def test_forward_and_backward_run_on_lent_cores_and_give_them_back(tmp_path):
    base = torch.get_num_threads()
    log: list[tuple[str, int, int]] = []
    model = _Model(log)
    owner = CoreOwner(tmp_path, "replica-0", timeout_s=10)
    lender = ThreadLender(CoreBorrower(tmp_path, {"replica-0": 2}), base)
    assert lender.install(model) == 3
    try:
        with lender.section():
            model(torch.randn(2, 4)).backward()
        assert torch.get_num_threads() == base  # restored at the section's end
        assert [e[:2] for e in log] == [("fwd", 0), ("fwd", 1), ("fwd", 2)] + [
            ("bwd", 2),
            ("bwd", 1),
            ("bwd", 0),
        ]
        assert {e[2] for e in log} == {base + 2}  # every layer on the idle replica's cores too
        assert lender.borrower.borrowed_s > 0

        log.clear()
        model(torch.randn(2, 4)).backward()  # outside a section: nothing switches
        assert {e[2] for e in log} == {base} and lender.polls == 7  # 1 + 3 fwd + 3 bwd

        # the owner gets work during the forward of layer 0: from layer 1 on the trainer is
        # back on its own threads, and the owner's claim completes
        loop = asyncio.new_event_loop()
        th = threading.Thread(target=loop.run_forever, daemon=True)
        th.start()
        claimed = threading.Event()
        release = asyncio.Event()

        async def work():
            async with owner.working():
                claimed.set()
                await release.wait()

        fut = None

        def on_forward(i: int) -> None:
            nonlocal fut
            if i == 0 and fut is None:
                fut = asyncio.run_coroutine_threadsafe(work(), loop)
                time.sleep(0.1)  # the claim holds busy and waits for the lent cores
                assert not claimed.is_set()

        for layer in model.layers:
            layer.on_forward = on_forward
        log.clear()
        with lender.section():
            model(torch.randn(2, 4)).backward()
        assert claimed.wait(5)
        assert log[0] == ("fwd", 0, base + 2)
        assert {e[2] for e in log[1:]} == {base}
        assert owner.timeouts == 0
        loop.call_soon_threadsafe(release.set)
        fut.result(5)
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
    finally:
        lender.close()
        owner.close()
        torch.set_num_threads(base)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _LM(nn.Module):
    """Two blocks of two sub-blocks each, then an output head (as a HF causal LM exposes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(4, 3)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def test_polls_at_sub_blocks_and_the_output_head(tmp_path):
    """A replica that goes idle inside a layer, or during the head and the loss after the last
    layer, lends its cores from the next sub-block on: the trainer polls before every layer,
    every sub-block and the output head, forward and backward."""
    model = _LM()
    lender = ThreadLender(CoreBorrower(tmp_path, {"replica-0": 1}), torch.get_num_threads())
    assert lender.install(model) == 2
    try:
        with lender.section():
            model(torch.randn(2, 4, requires_grad=True)).backward()
        # 1 at the start; forward: 2 layers + 4 sub-blocks + head = 7; backward: the same 7
        assert lender.polls == 1 + 7 + 7
    finally:
        lender.close()
