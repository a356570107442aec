"""Every CPU-only fast path of the engine, attached to a model runner by `backend.CpuBackend.attach`.

Importing the package gives model/quant.py and codec/decoder.py the CPU kernels they call (`backend.set_hooks`):
those hooks are the only way model/ and codec/ code reaches this package."""
from tts_engine.cpu.backend import set_hooks as _set_hooks

_set_hooks()
