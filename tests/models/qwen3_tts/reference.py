"""Reference Qwen3-TTS outputs from the `qwen-tts` package, run in the separate virtualenv that
tools/qwen_tts_reference_env.sh builds (its transformers 4.57 pin; never imported by the project's env).

    python reference.py MODEL_DIR REQUESTS_JSON OUT_DIR SCHEDULE

REQUESTS_JSON is a list of {"text", "speaker", "language", "instruct", "max_new_tokens"}. Each request runs
alone (no left padding) through `Qwen3TTSForConditionalGeneration.generate` with greedy decoding of the talker
and the code predictor, the streaming-text layout (`non_streaming_mode=False`) and no repetition penalty, then
`speech_tokenizer.decode`. Writes OUT_DIR/codes.json (per request: frames x codebooks), OUT_DIR/wav_<i>.npy and
OUT_DIR/chunked_<i>.npy: the reference decoder run on the chunks of SCHEDULE (a JSON list of frame counts, the
last repeating, each chunk with 25 frames of left context as the decoder's own `chunked_decode`), the pipeline's
streamed decoding.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from qwen_tts import Qwen3TTSModel

LEFT_CONTEXT = 25


def chunked(decoder, codes: torch.Tensor, schedule: list[int]) -> np.ndarray:
    """`decoder.chunked_decode` with chunk i of `schedule[i]` frames (the last size repeating)."""
    wavs, start, index = [], 0, 0
    while start < codes.shape[-1]:
        end = min(start + schedule[min(index, len(schedule) - 1)], codes.shape[-1])
        context = LEFT_CONTEXT if start - LEFT_CONTEXT > 0 else start
        wavs.append(decoder(codes[..., start - context:end])[..., context * decoder.total_upsample:])
        start, index = end, index + 1
    return torch.cat(wavs, dim=-1)[0, 0].numpy()


def main(model_dir: str, requests_path: str, out_dir: str, schedule: str) -> None:
    torch.manual_seed(0)
    tts = Qwen3TTSModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = Path(out_dir)
    codes_out = []
    for i, req in enumerate(json.loads(Path(requests_path).read_text())):
        input_ids = tts._tokenize_texts([tts._build_assistant_text(req["text"])])
        instruct = req.get("instruct")
        instruct_ids = [tts._tokenize_texts([tts._build_instruct_text(instruct)])[0] if instruct else None]
        codes, _ = tts.model.generate(
            input_ids=input_ids, instruct_ids=instruct_ids, languages=[req.get("language") or "auto"],
            speakers=[req.get("speaker")], non_streaming_mode=False, max_new_tokens=req["max_new_tokens"],
            do_sample=False, subtalker_dosample=False, repetition_penalty=1.0)
        wavs, rate = tts.model.speech_tokenizer.decode([{"audio_codes": c} for c in codes])
        assert rate == 24000, rate
        codes_out.append(codes[0].tolist())
        np.save(out / f"wav_{i}.npy", np.asarray(wavs[0], dtype=np.float32))
        decoder = tts.model.speech_tokenizer.model.decoder
        with torch.no_grad():
            np.save(out / f"chunked_{i}.npy", chunked(decoder, codes[0].T.unsqueeze(0), json.loads(schedule)))
    (out / "codes.json").write_text(json.dumps(codes_out))


if __name__ == "__main__":
    main(*sys.argv[1:5])
