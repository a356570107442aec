import sys

from tts_engine.cli import main

sys.exit(main())
