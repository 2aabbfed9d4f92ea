"""``run.compile``: a training step through ``torch.compile``, with CUDA graphs in "reduce-overhead" mode on a GPU,
falling back to the uncompiled step after one warning where compiling or a compiled call fails. The batched
executor compiles its vmapped step with it, the sequential loop its algorithm's ``loss`` gradient."""

from __future__ import annotations

import warnings
from typing import Any

import torch

COMPILE_BACKEND = "inductor"  # torch.compile's backend for run.compile (the tests: "aot_eager", no code generated)


class Compiled:
    """``fn`` compiled by ``torch.compile`` in ``mode`` (``run.compile``; "off": ``fn`` itself, ``on`` False).

    Shapes that change between calls (a group's active rows as its clients finish, the short last batch of a pass)
    are compiled once fixed and, at their second value, once more as dynamic (torch's automatic dynamic shapes), so
    a run compiles a step at most twice, three times where a size of 1 comes (a last batch of one sample, which torch
    compiles apart from every other size). Where a dynamic size cannot be traced, each size is compiled apart (up
    to torch's recompile limit of 8 graphs; further sizes run uncompiled, the same function). CUDA graphs
    ("reduce-overhead" on CUDA) record one replay per shape, and the outputs are copied out before the next replay
    overwrites them. Where compiling or a compiled call fails (with each size apart too), ``fn`` runs instead for the
    rest of the run, after one warning naming ``what`` failed. ``fn`` must be a pure function of its arguments (no
    state of its own changed), so that the fallback's call replaces the failed one exactly."""

    def __init__(self, fn: Any, mode: str, device: torch.device, what: str) -> None:
        self.fn, self.mode, self.what = fn, mode, what
        self.on = mode != "off"
        self.graphs = mode == "reduce-overhead" and device.type == "cuda"
        self.static = False  # every shape compiled apart (after dynamic shapes failed)
        self.compiled = self._compile() if self.on else fn

    def _compile(self) -> Any:
        options: dict[str, Any] = {"dynamic": False} if self.static else {}
        if COMPILE_BACKEND == "inductor" and self.mode != "default":
            options["mode"] = self.mode
        return torch.compile(self.fn, backend=COMPILE_BACKEND, **options)

    def __call__(self, *args: Any) -> Any:
        if not self.on:
            return self.fn(*args)
        try:
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = self.compiled(*args)
        except Exception as err:
            if not self.static:
                # some ops cannot be traced with a dynamic size (dropout under torch.func's grad with a symbolic
                # batch size): compile each size apart, up to torch's recompile limit (8; beyond it, uncompiled)
                self.static = True
                self.compiled = self._compile()
                return self(*args)
            warnings.warn(
                f"run.compile = {self.mode!r}: {self.what} failed to compile or run ({type(err).__name__}: "
                f"{str(err)[:300]}); it runs uncompiled from here",
                RuntimeWarning,
                stacklevel=3,
            )
            self.on = False
            return self.fn(*args)
        if self.graphs:
            return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        return out
