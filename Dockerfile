# Qwen3-TTS Live: the Gradio app in a container (also usable as a Hugging Face Docker Space).
#   docker build -t qwen3-tts-live .
#   docker run --gpus all -p 7860:7860 -v hf-cache:/home/user/.cache qwen3-tts-live
# Flags go after the image name, e.g. `... qwen3-tts-live python app.py --tiny`; every flag also has an
# environment variable (TTS_DEVICE, TTS_BASE_MODEL, ...; see `python app.py --help`).
FROM python:3.11-slim

# ffmpeg is optional (the app, its streaming and its tests run without it); it is kept because it reads
# compressed reference clips that libsndfile cannot (m4a, aac, webm, ...) and lets the Gradio endpoints also
# stream live audio chunks to gradio_client. mp3 export does not use it (libsndfile encodes mp3).
# g++ builds our own CPU kernels (tts_engine/cpu/csrc/, one library) below, at image build time (optional: without it
# the plain PyTorch paths serve).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ffmpeg g++ \
 && rm -rf /var/lib/apt/lists/*

# Hugging Face Spaces run containers as uid 1000
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860
WORKDIR /home/user/app

COPY --chown=user requirements.txt .
RUN pip install --user -r requirements.txt

COPY --chown=user . .
# our C++ library for this torch, built now (as the app's user: into the cache folder the app looks in), so no
# request waits for a compiler; prints where and how long, and exits 0 without a compiler
RUN python -m tts_engine.cpu.build

EXPOSE 7860
CMD ["python", "app.py", "--host", "0.0.0.0", "--port", "7860"]
