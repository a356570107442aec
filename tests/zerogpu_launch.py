"""Test launcher: `python tests/zerogpu_launch.py [app.py flags]` runs the app under the real `spaces` package in
ZeroGPU mode (SPACES_ZERO_GPU=true, SPACES_ZERO_DEVICE_API_URL at a stand-in service, tests/zerogpu_service.py)
on a machine without a GPU.

Everything is the package's own code (its CUDA stand-in in the main process, the packing of the "cuda" tensors at
launch, the scheduling calls, the forked worker, the relay of yields, the quota errors) except the two steps of
the worker that touch a real device, `spaces.zero.torch.init` and `spaces.zero.torch.move`, replaced here:
`init` initialises no device, `move` reads the packed tensors back into RAM (instead of onto a GPU) and turns the
package's own CUDA stand-in on again in the worker, for every thread of it, so the worker's "cuda" runs on the CPU.
A CPU build of torch also needs `torch.version.cuda`, `torch._C._cuda_init` and a picklable
`torch.cuda._is_in_bad_fork` for the package to import.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch

if torch.version.cuda is None:           # a CPU build: the package reads the CUDA version and keeps _cuda_init
    torch.version.cuda = "12.8"
if not hasattr(torch._C, "_cuda_init"):
    torch._C._cuda_init = lambda: None


def _is_in_bad_fork() -> bool:   # the CPU build's is a lambda, which the package's check cannot pickle
    return False


if not hasattr(torch._C, "_cuda_isInBadFork"):
    _is_in_bad_fork.__module__, _is_in_bad_fork.__qualname__ = "torch.cuda", "_is_in_bad_fork"
    torch.cuda._is_in_bad_fork = _is_in_bad_fork

import spaces  # noqa: E402,F401  the real package (ZeroGPU on: it patches torch now)
import spaces.zero.torch as zero_torch  # noqa: E402
from spaces.zero.torch import patching  # noqa: E402


def init(nvidia_uuid: str) -> None:
    """The worker's device initialisation: there is no device here."""
    os.environ["CUDA_VISIBLE_DEVICES"] = nvidia_uuid


def _read_pack(pack) -> None:
    """Read one pack file (spaces.zero.torch.packing.pack_tensors wrote it) back into CPU tensors and make them the
    data behind their "cuda" tensors again."""
    with open(pack.path(), "rb") as f:
        for meta, size, aligned in [t for batch in pack.batches for t in batch] + list(pack.big_tensors):
            data = f.read(aligned)
            t = torch.empty_like(meta)           # the layout `pack_tensors` wrote: its storage, `size` bytes
            ctypes.memmove(t.untyped_storage().data_ptr(), data, size)
            for fake in pack.fakes[meta]:
                patching.cuda_aliases[fake] = t


def move(callback=None) -> None:
    """Instead of copying the packed tensors to a GPU: back into RAM, with the package's CUDA stand-in on in every
    thread of this worker (the function runs in a thread the package starts)."""
    for pack in patching.tensor_packs:
        _read_pack(pack)
    zero_torch.patch()
    torch.cuda.is_current_stream_capturing = lambda: False   # the CPU build's raises; no graph is ever captured
    run = threading.Thread.run

    def run_with_stand_in(self):
        zero_torch.enter_mode()
        run(self)

    threading.Thread.run = run_with_stand_in


zero_torch.init = init
zero_torch.move = move

if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: every thread's stack
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import app

    app.main(sys.argv[1:])
