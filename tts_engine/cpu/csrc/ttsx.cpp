// The one shared library of our CPU kernels (tts_engine/cpu/cpu_ext.py `build`): every source of this folder in one
// translation unit, compiled once per source, torch and machine (`python -m tts_engine.cpu.build` at install, else in
// the background on first use) and loaded once per process through ctypes. Each Python wrapper declares the C
// functions it calls on this one library:
//   cpu_ext.cpp          ttsx_*  W8A8 / W4A8 matmuls, SnakeBeta, uint8 quantisation, the CPU level   (cpu_ext.py)
//   fused_step.cpp       ttsf_*  a decoder stack's fused decode step                                 (fused_step.py)
//   predictor_frame.cpp  ttsp_*  the code predictor's whole frame                                    (predictor_frame.py)
//   talker_step.cpp      ttst_*  the talker's whole step                                             (talker_step.py)
//   codec_int8_rows.cpp  ttsc_*  the codec's batched int8 convolutions' per-row epilogue             (int8_conv.py)
// One library means one CPU level and one work-sharing mode for every kernel of the process (cpu_ext.set_level,
// set_share). Each file includes the one it builds on (talker_step -> predictor_frame -> fused_step -> cpu_ext;
// codec_int8_rows -> cpu_ext) and is guarded by `#pragma once`, so the order below only documents the layers.
#include "cpu_ext.cpp"
#include "fused_step.cpp"
#include "predictor_frame.cpp"
#include "talker_step.cpp"
#include "codec_int8_rows.cpp"
