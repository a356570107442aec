"""`python -m tts_engine.cpu.build`: build our one C++ library (`cpu_ext.LIBRARY`) for this torch at install time, so
that no request ever waits for a compiler (the Dockerfile and the README's install line run it).

It goes where the app looks first (`cpu_ext.build_dirs()`: $TTS_BUILD_DIR, else the cache folder in force, by default
~/.cache/qwen3-tts-live/cpu_ext; run it as the user that runs the app, with the same TTS_CACHE_DIR if any). One line
says where and how long. Exit status 0 also where nothing can be built (no compiler, not x86-64 Linux,
TTS_CPU_EXT=0): the app then builds it in the background or serves on the plain PyTorch paths (cpu_build), and the
line says why. --force compiles again over an existing build; --check exits 1 where no library is built (CI)."""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tts_engine.cpu.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--force", action="store_true", help="compile again even where a build exists")
    p.add_argument("--check", action="store_true", help="build nothing; exit 1 where no library is built")
    a = p.parse_args(argv)

    from tts_engine.cpu import cpu_ext

    if not cpu_ext.enabled():
        print(f"tts_engine.cpu.build: nothing built ({cpu_ext.ENABLE_ENV}=0: the plain PyTorch paths serve)")
        return 0
    if a.check:
        found = cpu_ext.built()
        print(f"tts_engine.cpu.build: {found if found else 'not built (looked in ' + ', '.join(map(str, cpu_ext.build_dirs())) + ')'}")
        return 0 if found else 1
    was = cpu_ext.built()
    t = time.perf_counter()
    try:
        out = cpu_ext.build(force=a.force)
    except Exception as e:   # noqa: BLE001 - no compiler, another CPU architecture, a compile error: not an install failure
        print(f"tts_engine.cpu.build: nothing built ({e}); the app serves on the plain PyTorch paths")
        return 0
    took = time.perf_counter() - t
    if was == out and not a.force:
        print(f"tts_engine.cpu.build: already built: {out}")
    else:
        print(f"tts_engine.cpu.build: built {out} in {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
