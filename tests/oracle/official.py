"""Import helper for the official implementation (qwen-tts 0.1.1), run only inside the oracle venv.

`import qwen_tts` eagerly imports its 25 Hz tokenizer modules, which need `sox`, `onnxruntime` and
`torchaudio` (no CPU build of torchaudio exists here). None of them is used on the 12 Hz path, so we
register empty stand-ins before importing it. transformers is imported first so that its own
optional-package probes see the real environment.
"""
import sys
import types

import transformers  # noqa: F401  (must come before the stand-ins)
import transformers.generation  # noqa: F401
import transformers.modeling_utils  # noqa: F401

for _name in ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
    sys.modules.setdefault(_name, types.ModuleType(_name))

import qwen_tts  # noqa: E402,F401
from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer  # noqa: E402,F401
from qwen_tts.core.models import (  # noqa: E402,F401
    Qwen3TTSConfig,
    Qwen3TTSForConditionalGeneration,
)
from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model  # noqa: E402,F401
