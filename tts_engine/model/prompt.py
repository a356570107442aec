"""Prompt assembly: the talker's prefill embeddings and the trailing text track, as the official
`Qwen3TTSForConditionalGeneration.generate` builds them (reference notes section 3.3).

Every position is the sum of a text-track vector T(id) and a codec-track vector C(id):
  [instruct block]  T(instruct tokens)                                      (text only)
  role block        T(<|im_start|>) T(assistant) T(\\n)                     (text only)
  control block     tts_pad... tts_bos  +  C(think/nothink, think_bos, [lang], think_eos) [speaker] C(pad)
  then one of
    streaming text:     T(text_0) + C(codec_bos); trailing = T(text_1..n-1), tts_eos
    non-streaming text: T(text_i) + C(pad) for all i, tts_eos + C(pad), tts_pad + C(codec_bos); trailing = tts_pad
    ICL:                reference text ++ target text against [codec_bos, reference frames] (see `_icl`)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tts_engine.config import ModelConfig
from tts_engine.model.talker import Talker


@dataclass
class Prompt:
    prefill: torch.Tensor    # [L, D] talker input embeddings
    trailing: torch.Tensor   # [N, D] text-track vectors added to frames 1..N of generation, then tts_pad
    prefix_len: int = 0      # the first positions that do not depend on the text (instruct, role and control
                             # blocks: the voice's part): the same for every request of a voice (prefix cache)


class PromptBuilder:
    """Owns the per-model hot buffers (tts pad/bos/eos text vectors) and builds prompts."""

    def __init__(self, cfg: ModelConfig, talker: Talker):
        self.cfg = cfg
        self.talker = talker
        dev = talker.model.norm.weight.device
        ids = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id], device=dev)
        with torch.inference_mode():
            self.tts_bos, self.tts_eos, self.tts_pad = talker.text_embed(ids).unbind(0)  # each [D]
        self.device = dev

    def _c(self, ids: list[int]) -> torch.Tensor:
        return self.talker.codec_embed(torch.tensor(ids, device=self.device))

    def _t(self, ids: torch.Tensor) -> torch.Tensor:
        return self.talker.text_embed(ids)

    @torch.inference_mode()
    def build(self, text_ids: torch.Tensor, *, language_id: int | None, speaker: torch.Tensor | None,
              instruct_ids: torch.Tensor | None = None, non_streaming: bool = False,
              ref_text_ids: torch.Tensor | None = None, ref_codes: torch.Tensor | None = None) -> Prompt:
        """text_ids: ids of the assistant template [n+8]; speaker: [D] vector for the speaker slot or None;
        instruct_ids: ids of the user template or None; ref_text_ids/ref_codes: the ICL reference
        (ref template ids, codes [R, 16]) or None."""
        tc = self.cfg.talker
        parts = []
        if instruct_ids is not None:
            parts.append(self._t(instruct_ids))
        parts.append(self._t(text_ids[:3]))  # role block
        ctrl = ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if language_id is None
                else [tc.codec_think_id, tc.codec_think_bos_id, language_id, tc.codec_think_eos_id])
        codec = [self._c(ctrl)]
        if speaker is not None:
            codec.append(speaker.to(self.device, self.tts_pad.dtype).view(1, -1))
        codec.append(self._c([tc.codec_pad_id, tc.codec_bos_id]))
        codec = torch.cat(codec)  # [K, D]; the last row (codec_bos) is used below
        n_ctrl = codec.shape[0] - 1
        text_track = torch.cat([self.tts_pad.expand(n_ctrl - 1, -1), self.tts_bos[None]])
        parts.append(text_track + codec[:-1])
        codec_bos = codec[-1:]
        prefix_len = sum(p.shape[0] for p in parts)   # nothing after this point is the same for every text

        if ref_codes is not None:
            icl, trailing = self._icl(text_ids[3:-5], ref_text_ids[3:-2], ref_codes, non_streaming)
            parts.append(icl)
        elif non_streaming:
            body = torch.cat([self._t(text_ids[3:-5]), self.tts_eos[None]])
            parts.append(body + self._c([tc.codec_pad_id] * body.shape[0]))
            parts.append(self.tts_pad[None] + codec_bos)
            trailing = self.tts_pad[None]
        else:
            parts.append(self._t(text_ids[3:4]) + codec_bos)
            trailing = torch.cat([self._t(text_ids[4:-5]), self.tts_eos[None]])
        return Prompt(prefill=torch.cat(parts), trailing=trailing, prefix_len=prefix_len)

    def _icl(self, text_ids, ref_ids, ref_codes, non_streaming):
        tc = self.cfg.talker
        text = torch.cat([self._t(torch.cat([ref_ids, text_ids])), self.tts_eos[None]])          # [r+n+1, D]
        codec = torch.cat([self._c([tc.codec_bos_id]), self.talker.frame_embed(ref_codes.to(self.device))])  # [R+1, D]
        if non_streaming:
            head = text + self._c([tc.codec_pad_id] * text.shape[0])
            return torch.cat([head, codec + self.tts_pad]), self.tts_pad[None]
        if text.shape[0] > codec.shape[0]:
            return text[:codec.shape[0]] + codec, text[codec.shape[0]:]
        pad = self.tts_pad.expand(codec.shape[0] - text.shape[0], -1)
        return torch.cat([text, pad]) + codec, self.tts_pad[None]
